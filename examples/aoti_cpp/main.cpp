// kha_aoti_runner: run an AOTInductor package written by kc.export_aoti, from C++ (no Python, no kha_compile).
//
//   kha_aoti_runner MODEL.pt2 --ids IDS.txt      IDS.txt: "B S", then B*S token ids (whitespace separated)
//   kha_aoti_runner MODEL.pt2 B S [VOCAB]        ids[b][s] = (31 b + 7 s + 3) % VOCAB   (VOCAB default 128)
//   ... --generate N                             greedy generation of N tokens after the prompt (ids above)
//                                                with a package of kc.export_aoti(..., generation=True)
//
// One forward: the package's inputs are read from its metadata "kha_compile.input_names" (comma-separated,
// in order): input_ids from the arguments, attention_mask ones, token_type_ids zeros. Prints, one item a line:
//   meta KEY VALUE                 every metadata entry (read without loading the model)
//   output I NAME shape D0 D1 ...  then  values I v0 v1 ...   (row-major, %.9g)
//   time load_ms first_run_ms second_run_ms
// Generation (--generate N): the package holds a static KV cache ("kha_compile.cache": max_cache_len,
// max_batch) and takes (input_ids, cache_position). The prompt runs once (prefill, positions 0..S-1), then
// one token per call at position S, S+1, ... (decode); the next token is the argmax of the last logits.
// Prints the meta lines, then
//   tokens B  t0 t1 ...            per sequence: the prompt and the N new tokens
//   gentime load_ms prefill_ms decode_ms_per_token
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

at::Tensor read_ids(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  int64_t b = 0, s = 0;
  if (!(in >> b >> s) || b < 1 || s < 1) throw std::runtime_error(path + ": the first line must be 'B S'");
  std::vector<int64_t> ids(b * s);
  for (auto& x : ids)
    if (!(in >> x)) throw std::runtime_error(path + ": expected " + std::to_string(b * s) + " token ids");
  return at::from_blob(ids.data(), {b, s}, at::kLong).clone();  // (B, S)
}

at::Tensor pattern_ids(int64_t b, int64_t s, int64_t vocab) {
  at::Tensor ids = at::empty({b, s}, at::kLong);  // (B, S)
  auto a = ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < s; ++j) a[i][j] = (31 * i + 7 * j + 3) % vocab;
  return ids;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

std::string get(const std::unordered_map<std::string, std::string>& meta, const std::string& key,
                const std::string& fallback) {
  auto it = meta.find(key);
  return it == meta.end() ? fallback : it->second;
}

// the integer after "KEY": in a flat JSON object (the metadata "kha_compile.cache"); -1 if absent
int64_t json_int(const std::string& json, const std::string& key) {
  auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::stoll(json.substr(at + key.size() + 3));
}

at::Tensor last_argmax(const std::vector<at::Tensor>& outputs) {
  return outputs.at(0).select(1, -1).argmax(-1);  // logits (B, S, V) -> next ids (B,)
}

// Greedy generation over the package's static KV cache: prefill the prompt, then decode one token per call.
int generate(torch::inductor::AOTIModelPackageLoader& loader, const std::unordered_map<std::string, std::string>& meta,
             const at::Tensor& ids, int64_t n, Clock::time_point t0, Clock::time_point t1) {
  const std::string cache = get(meta, "kha_compile.cache", "");
  if (cache.find("\"static\"") == std::string::npos)
    throw std::runtime_error("not a generation package (no static KV cache in kha_compile.cache): write it with "
                             "kc.export_aoti(model, path, generation=True)");
  const int64_t max_len = json_int(cache, "max_cache_len"), max_batch = json_int(cache, "max_batch");
  const int64_t b = ids.size(0), s = ids.size(1);
  if (n < 1 || b > max_batch || s + n - 1 > max_len) {
    std::cerr << "error: " << b << " prompt(s) of " << s << " tokens + " << n << " new tokens need " << b << " x "
              << s + n - 1 << " cache positions; the package holds " << max_batch << " x " << max_len << "\n";
    return 1;
  }
  c10::InferenceMode no_autograd;
  std::vector<at::Tensor> tokens = {ids};
  at::Tensor next = last_argmax(loader.run({ids, at::arange(s, at::kLong)}));  // prefill: positions 0..s-1
  auto t2 = Clock::now();
  tokens.push_back(next.unsqueeze(1));
  for (int64_t t = 1; t < n; ++t) {  // decode: the last token at position s + t - 1
    next = last_argmax(loader.run({next.unsqueeze(1), at::full({1}, s + t - 1, at::kLong)}));
    tokens.push_back(next.unsqueeze(1));
  }
  auto t3 = Clock::now();
  at::Tensor all = at::cat(tokens, 1).contiguous();  // (B, S + N)
  auto a = all.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i) {
    std::cout << "tokens " << i;
    for (int64_t j = 0; j < all.size(1); ++j) std::cout << " " << a[i][j];
    std::cout << "\n";
  }
  std::cout << "gentime " << ms(t0, t1) << " " << ms(t1, t2) << " " << (n > 1 ? ms(t2, t3) / (n - 1) : 0.0) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args;  // the arguments after MODEL, without "--generate N"
  int64_t generate_n = 0;
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) == "--generate" && i + 1 < argc) generate_n = std::stoll(argv[++i]);
    else args.emplace_back(argv[i]);
  }
  if (argc < 3 || args.empty()) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt2 (--ids IDS.txt | B S [VOCAB]) [--generate N]\n";
    return 2;
  }
  const std::string package = argv[1];
  try {
    at::Tensor ids;
    if (args[0] == "--ids") {
      if (args.size() < 2) throw std::runtime_error("--ids needs a file");
      ids = read_ids(args[1]);
    } else {
      if (args.size() < 2) throw std::runtime_error("give B and S (batch and sequence length), or --ids IDS.txt");
      ids = pattern_ids(std::stoll(args[0]), std::stoll(args[1]), args.size() > 2 ? std::stoll(args[2]) : 128);
    }

    // the metadata, without loading the model's shared library
    auto meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(package, "model");
    for (const auto& [key, value] : std::map<std::string, std::string>(meta.begin(), meta.end()))
      std::cout << "meta " << key << " " << value << "\n";  // sorted by key

    auto t0 = Clock::now();
    torch::inductor::AOTIModelPackageLoader loader(package);  // extracts the package, dlopens its model
    auto t1 = Clock::now();
    if (generate_n > 0) return generate(loader, meta, ids, generate_n, t0, t1);

    std::vector<at::Tensor> inputs;  // in the package's order
    for (const auto& name : split(get(meta, "kha_compile.input_names", "input_ids"))) {
      if (name == "input_ids") inputs.push_back(ids);
      else if (name == "attention_mask") inputs.push_back(at::ones_like(ids));
      else if (name == "token_type_ids") inputs.push_back(at::zeros_like(ids));
      else throw std::runtime_error("this runner cannot make the input '" + name + "'");
    }
    std::vector<std::string> output_names = split(get(meta, "kha_compile.output_names", ""));

    c10::InferenceMode no_autograd;
    std::vector<at::Tensor> outputs = loader.run(inputs);
    auto t2 = Clock::now();
    loader.run(inputs);  // a second call: the steady-state time
    auto t3 = Clock::now();

    for (size_t i = 0; i < outputs.size(); ++i) {
      at::Tensor out = outputs[i].contiguous().to(at::kDouble);
      std::cout << "output " << i << " " << (i < output_names.size() ? output_names[i] : "?") << " shape";
      for (auto d : out.sizes()) std::cout << " " << d;
      std::cout << "\nvalues " << i;
      const double* p = out.data_ptr<double>();
      char buf[32];
      for (int64_t j = 0; j < out.numel(); ++j) {
        std::snprintf(buf, sizeof buf, " %.9g", p[j]);
        std::cout << buf;
      }
      std::cout << "\n";
    }
    std::cout << "time " << ms(t0, t1) << " " << ms(t1, t2) << " " << ms(t2, t3) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

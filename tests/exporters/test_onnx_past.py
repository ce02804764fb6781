"""kha_compile.export_onnx(past=True): the with-past decoder file and genai_config.json, run by onnxruntime-genai,
by a plain onnxruntime loop and (on a machine with TensorRT) by a TensorRT engine built from the same file.

References: transformers' own ``generate`` on the KHA model (greedy tokens), and the model's forward over
the whole sequence without a cache (logits). Two exports are shared by the module (about 10-20 s each on
two busy cores): a Llama-style model (GQA) with linear KHA on q and k (folded) and MLP-value KHA on v, and a
Qwen3-style model (GQA, q/k RMSNorm) with linear KHA on q, k and v, all folded into the file; both with
perturbed (trained-like) KHA weights.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import kha_compile as kc
import zoo
from helpers import kha_params, perturb
from kha_compile.core.errors import CacheLayoutError, ExportError, NoKVCacheError
from kha_compile.exporters import generate_genai, generate_onnx, generate_tensorrt
from kha_compile.exporters.onnx import MLP_VALUE_DOMAIN, MLP_VALUE_OP, onnx_summary, read_kha_metadata
from kha_compile.exporters.tensorrt import export_tensorrt, profile_shapes
from kha_compile.exporters.tensorrt_aot import mark_aot_nodes

pytestmark = pytest.mark.slow  # onnxruntime-genai exports and generation

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
og = pytest.importorskip("onnxruntime_genai")

NEW = 12  # new tokens per generation
PROMPTS = [  # (batch, length): one prompt; two of one length (no padding)
    torch.tensor([[5, 17, 33, 9, 100]]),
    torch.tensor([[3, 4, 5, 6, 7, 8, 9], [90, 80, 70, 60, 50, 40, 30]]),
]
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


def _model(name: str, cfg: kc.KHAConfig, eos: int) -> torch.nn.Module:
    model = zoo.make(name).model
    kc.apply(model, cfg)
    perturb(model)
    model.generation_config.eos_token_id = eos  # an id the random model may well produce: both must stop there
    return model


@pytest.fixture(scope="module")
def llama_mlp(tmp_path_factory):
    """(Llama with linear KHA on q, k and MLP-value on v, the genai directory): created by the export."""
    model = _model("llama", kc.KHAConfig(q="linear", k="linear", v="mlp"), eos=2)
    out = tmp_path_factory.mktemp("past") / "llama_genai"
    path = kc.export_onnx(model, out, past=True)
    assert path == out / "model.onnx"
    return model, path


@pytest.fixture(scope="module")
def qwen3_linear(tmp_path_factory):
    """(Qwen3 with linear KHA on q, k, v, its file): given as a .onnx path, folded."""
    model = _model("qwen3", kc.KHAConfig(q="linear", k="linear", v="linear"), eos=127)
    path = kc.export_onnx(model, tmp_path_factory.mktemp("past") / "qwen3.onnx", past=True)
    return model, path


@pytest.fixture(params=["llama_mlp", "qwen3_linear"])
def exported(request):
    return request.getfixturevalue(request.param)


def _hf_generate(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )


def _genai_generate(directory, prompt: torch.Tensor) -> torch.Tensor:
    """onnxruntime-genai as its documentation writes it: Model(dir), GeneratorParams, append_tokens, a loop."""
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + NEW, do_sample=False, batch_size=prompt.shape[0])
    generator = og.Generator(model, params)
    generator.append_tokens(prompt.numpy().astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return torch.stack([torch.from_numpy(np.asarray(generator.get_sequence(i))) for i in range(prompt.shape[0])])


@pytest.mark.parametrize("prompt", PROMPTS, ids=["batch1", "batch2"])
def test_onnxruntime_genai_generates_what_transformers_generates(exported, prompt):
    model, path = exported
    want = _hf_generate(model, prompt)
    got = _genai_generate(path.parent, prompt)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["batch1", "batch2"])
def test_a_plain_onnxruntime_loop_over_the_file_generates_the_same(exported, prompt):
    model, path = exported
    want = _hf_generate(model, prompt)
    eos = model.generation_config.eos_token_id
    assert generate_onnx(path, prompt, NEW, eos_token_id=eos, pad_token_id=0).tolist() == want.tolist()


def test_the_tokens_depend_on_the_kha_weights(llama_mlp):
    """Without this the equalities above could hold for a file that ignores KHA."""
    model, path = llama_mlp
    prompt = PROMPTS[1]
    plain = zoo.make("llama").model  # the same seeded weights, no KHA
    plain.generation_config.eos_token_id = 2
    assert _hf_generate(plain, prompt).tolist() != _hf_generate(model, prompt).tolist()
    assert generate_genai(path.parent, prompt, NEW).tolist() == _hf_generate(model, prompt).tolist()


@pytest.mark.parametrize("batch, past, seq", [(1, 0, 4), (3, 6, 1), (2, 5, 3)])
def test_batch_sequence_and_past_are_dynamic(llama_mlp, batch, past, seq):
    """A prefill of ``past`` tokens, then ``seq`` more with its cache, against one forward over all of them."""
    model, path = llama_mlp
    ids = torch.randint(0, zoo.VOCAB, (batch, past + seq), generator=torch.Generator().manual_seed(past))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits[:, past:]  # (B, S, V)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    cache = {n: np.zeros((batch, 2, 0, zoo.HEAD_DIM), np.float32) for n in names}  # (B, H_kv, 0, D)
    for start, stop in ((0, past), (past, past + seq)):
        if stop == start:
            continue
        feeds = {
            "input_ids": ids[:, start:stop].numpy(),
            "attention_mask": np.ones((batch, stop), np.int64),
            "position_ids": np.tile(np.arange(start, stop), (batch, 1)),
            **cache,
        }
        logits, *present = sess.run(None, feeds)
        assert all(p.shape == (batch, 2, stop, zoo.HEAD_DIM) for p in present)
        cache = dict(zip(names, present))
    np.testing.assert_allclose(logits, want.numpy(), atol=1e-4, rtol=0)


def test_inputs_outputs_and_named_dynamic_axes(exported):
    _, path = exported
    s = onnx_summary(path)
    inputs = {i.name: (i.dtype, i.dims) for i in s.inputs}
    assert inputs["input_ids"] == ("int64", ("batch", "sequence"))
    assert inputs["attention_mask"] == ("int64", ("batch", "total_sequence"))
    assert inputs["position_ids"] == ("int64", ("batch", "sequence"))
    for i in range(2):
        for kv in ("key", "value"):
            assert inputs[f"past_key_values.{i}.{kv}"] == ("float32", ("batch", 2, "past_sequence", zoo.HEAD_DIM))
    outputs = {o.name: o.dims for o in s.outputs}
    assert outputs["logits"] == ("batch", "sequence", zoo.VOCAB)
    assert outputs["present.1.value"] == ("batch", 2, "past_sequence + sequence", zoo.HEAD_DIM)
    assert len(s.inputs) == 3 + 4 and len(s.outputs) == 1 + 4


def test_mlp_value_nodes_keep_their_function_body_and_plugin_attributes(llama_mlp, qwen3_linear):
    model, path = llama_mlp
    s = onnx_summary(path)
    assert s.num_custom_nodes == 2 and (MLP_VALUE_DOMAIN, MLP_VALUE_OP) in s.functions
    proto = onnx.load(str(path))
    node = next(n for n in proto.graph.node if n.op_type == MLP_VALUE_OP)
    assert {a.name: a.s.decode() for a in node.attribute} == {"plugin_namespace": "kha", "plugin_version": "1"}
    kha_weights = [i.name for i in proto.graph.initializer if ".kha." in i.name]
    assert len(kha_weights) == 2 * 3 and all(".kha.v." in n for n in kha_weights)  # q and k folded
    assert mark_aot_nodes(proto) == 2  # what export_tensorrt does before parsing: both take the AOT kernel (d 16)
    assert len(kha_params(model)) == 2 * 5, "export_onnx(past=True) must not fold or strip the caller's model"
    folded = onnx.load(str(qwen3_linear[1]))
    assert onnx_summary(folded).num_custom_nodes == 0
    assert not [i.name for i in folded.graph.initializer if "kha" in i.name]  # folded into q, k, v weights


def test_metadata_records_the_cache(llama_mlp, qwen3_linear):
    meta = read_kha_metadata(llama_mlp[1])
    assert meta["cache"] == {"kind": "dynamic", "num_layers": 2, "num_kv_heads": 2, "head_size": 16, "dtype": "float32"}
    assert meta["config"]["v"] == "mlp" and meta["config"]["q"] == "linear" and len(meta["sites"]) == 2
    assert meta["folded"] is True  # q and k
    assert read_kha_metadata(qwen3_linear[1])["folded"] is True


def test_the_tensorrt_profile_of_the_file_has_the_past_axis_and_runs(llama_mlp):
    """The profile export_tensorrt builds for the file: past length from 0, total = sequence + past."""
    _, path = llama_mlp
    ranges = {"batch": (1, 2, 3), "sequence": (1, 1, 4), "past_sequence": (0, 3, 6)}
    shapes = profile_shapes(onnx_summary(path).inputs, dim_ranges=ranges)
    assert shapes["attention_mask"] == ((1, 1), (2, 4), (3, 10))
    assert shapes["past_key_values.0.key"] == ((1, 2, 0, 16), (2, 2, 3, 16), (3, 2, 6, 16))
    assert shapes["input_ids"] == ((1, 1), (2, 1), (3, 4))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for k in range(3):  # every corner of the profile is a valid call of the file
        feeds = {
            n: np.ones(s[k], np.int64) if n in ("input_ids", "attention_mask") else None for n, s in shapes.items()
        }
        feeds["position_ids"] = np.ones(shapes["position_ids"][k], np.int64)
        feeds.update({n: np.zeros(s[k], np.float32) for n, s in shapes.items() if n.startswith("past")})
        (logits, *_) = sess.run(None, feeds)
        assert logits.shape == (*shapes["input_ids"][k], zoo.VOCAB)


@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT (pip install tensorrt, >= 10.7) and an NVIDIA GPU")
def test_tensorrt_engine_from_the_file_generates_what_transformers_generates(llama_mlp, tmp_path):
    model, path = llama_mlp
    engine = export_tensorrt(
        path,
        tmp_path / "llm.engine",
        precision="fp32",
        dim_ranges={"batch": (1, 1, 2), "sequence": (1, 1, 16), "past_sequence": (0, 16, 32)},
    )
    for prompt in PROMPTS:
        want = _hf_generate(model, prompt)
        assert generate_tensorrt(engine, prompt, NEW, eos_token_id=2, pad_token_id=0).tolist() == want.tolist()


# ---- bad input: a clear error, and nothing written ------------------------------------------------


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("bert", NoKVCacheError, "returned no KV cache"),
        ("gemma2", CacheLayoutError, "sliding-window"),
        ("qwen3", ExportError, "names no eos_token_id"),  # genai needs one; checked before writing
    ],
)
def test_a_model_the_file_cannot_serve_is_refused_before_anything_is_written(name, error, match, tmp_path):
    with pytest.raises(error, match=match):
        kc.export_onnx(zoo.make(name).model, tmp_path / "out", past=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"example_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.long)}}, "builds its own example inputs"),
        ({"output_names": ["y"]}, "names its inputs and outputs"),
        ({"dynamic": False}, "needs dynamic=True"),
    ],
)
def test_options_that_do_not_fit_a_cache_are_refused(kwargs, match, tmp_path):
    with pytest.raises(ExportError, match=match):
        kc.export_onnx(zoo.make("llama").model, tmp_path / "out", past=True, **kwargs)


def test_destinations(tmp_path):
    model = zoo.make("llama").model
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ExportError, match=r"is a file that does not end in \.onnx"):
        kc.export_onnx(model, tmp_path / "file.bin", past=True)
    with pytest.raises(ExportError, match="does not exist; create it first"):
        kc.export_onnx(model, tmp_path / "missing" / "out", past=True)

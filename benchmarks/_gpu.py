"""What the GPU suite's parts share: the run context (device, timer, time caps), the device's peaks, the report.

A part runs under :meth:`Run.part`: it has a time cap (checked between cases with :meth:`Run.left`, and
enforced by an alarm a little after it), and an out-of-memory error, a failed compile or the cap ends
the part, never the suite: what the part recorded so far is kept, with the reason it stopped.
"""

from __future__ import annotations

import contextlib
import gc
import json
import pathlib
import platform
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from _common import interleaved_times

# Datasheet peaks: (name fragments that must all occur in the device name, memory GB/s, dense 16-bit
# tensor TFLOP/s, source). First match wins, so the more specific names come first.
PEAKS = [
    (("GH200",), 4000.0, 989.0, "NVIDIA GH200 Grace Hopper Superchip datasheet"),
    (("H200",), 4800.0, 989.0, "NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e, 4.8 TB/s)"),
    (("H100", "NVL"), 3900.0, 835.0, "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL)"),
    (("H100", "PCIe"), 2000.0, 756.0, "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)"),
    (("H100",), 3350.0, 989.0, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, 80 GB HBM3, 3.35 TB/s)"),
    (("A100", "80GB"), 2039.0, 312.0, "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)"),
    (("A100",), 1555.0, 312.0, "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB)"),
]


def device_peaks(name: str) -> tuple[float | None, float | None, str]:
    """(peak memory GB/s, peak dense 16-bit TFLOP/s, source) of the device named ``name``."""
    for frags, gbs, tflops, source in PEAKS:
        if all(f.lower() in name.lower() for f in frags):
            return gbs, tflops, source
    return None, None, "not in the table (--peak-gbs gives one)"


def versions() -> dict[str, str | None]:
    """torch, CUDA, triton, transformers and Python versions (None where not installed)."""
    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    out["python"] = platform.python_version()
    return out


class PartTimeout(BaseException):
    """A part ran past its hard time cap (a BaseException: library code's ``except Exception`` lets it through)."""


@dataclass
class Run:
    """The suite's run: device, smoke mode, time caps, the report (printed and kept) and the JSON record."""

    device: torch.device
    smoke: bool
    compile_backend: str
    out_json: pathlib.Path
    out_txt: pathlib.Path
    record: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    _deadline: float = 0.0

    def say(self, text: str = "") -> None:
        """Print a line (with the seconds since the start) and keep it for the text file."""
        stamp = f"[{time.perf_counter() - self.t0:6.1f}s] " if text else ""
        print(stamp + text, flush=True)
        self.lines.append(text)

    def left(self) -> float:
        """Seconds left before the running part's soft cap."""
        return self._deadline - time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def times_ms(self, fns: dict[str, Callable[[], object]], repeats: int, inner: int, warmup: int = 1):
        """Median ms per call of each function, run in turns (``inner`` calls back to back per sample)."""
        samples = interleaved_times(fns, repeats, warmup=warmup, inner=inner, sync=self.sync)
        return {k: statistics.median(v) * 1e3 for k, v in samples.items()}

    @contextlib.contextmanager
    def part(self, name: str, cap_s: float) -> Iterator[dict]:
        """Run a part with a soft cap ``cap_s`` and a hard one (an alarm) at 1.25 x cap + 20 s; record its outcome."""
        rec: dict = {"status": "running", "cap_s": round(cap_s, 1)}
        self.record.setdefault("parts", {})[name] = rec
        self.say(f"== part {name} (time cap {cap_s:.0f} s)")
        start = time.perf_counter()
        self._deadline = start + cap_s
        hard = int(1.25 * cap_s + 20)

        def on_alarm(signum, frame):
            raise PartTimeout(f"part {name} ran past its hard cap of {hard} s")

        old = signal.signal(signal.SIGALRM, on_alarm) if hasattr(signal, "SIGALRM") else None
        if old is not None:
            signal.alarm(hard)
        try:
            yield rec
            rec["status"] = "done" if rec["status"] == "running" else rec["status"]
        except (Exception, PartTimeout) as e:  # OOM, a failed compile, the cap: the next part still runs
            rec["status"] = "failed"
            rec["error"] = f"{type(e).__name__}: {str(e).strip()[:800]}"
            rec["traceback"] = traceback.format_exc(limit=6)[-3000:]
            self.say(f"part {name} stopped: {rec['error'][:300]}")
        finally:
            if old is not None:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
            rec["seconds"] = round(time.perf_counter() - start, 1)
            self.say(f"part {name}: {rec['status']} in {rec['seconds']} s")
            free(self.device)
            self.write()

    def write(self) -> None:
        """Write the JSON record and the text report so far (after every part: a later crash keeps them)."""
        self.record["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.out_json.write_text(json.dumps(self.record, indent=1, default=str))
        self.out_txt.write_text("\n".join(self.lines) + "\n")


def free(device: torch.device) -> None:
    """Release what the last part held (its tensors must be out of scope) and compiled code's caches."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def slug(name: str) -> str:
    """A file-name part for a device: h100, h200, ... or its name in lower case with dashes."""
    low = name.lower()
    for key in ("gh200", "h200", "h100", "a100", "b200"):
        if key in low:
            return key
    return "".join(c if c.isalnum() else "-" for c in low).strip("-") or "device"

#!/usr/bin/env bash
# GPU check of the triton backend: runs tests/test_backend_triton.py with the kernels compiled on
# CUDA, then prints the measured agreement with the torch backend and a small decode-attention
# timing. Needs a CUDA GPU and the project installed (pip install -e ".[test,triton]").
# Usage (from anywhere):  bash scripts/gpu_check_triton.sh      (about 1-3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
unset TRITON_INTERPRET  # compiled kernels; Triton must not be imported in interpreter mode

"$PY" - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA GPU visible: this script checks the compiled kernels"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY

echo "== tests (compiled)"
"$PY" -m pytest -q tests/test_backend_triton.py -p no:randomly -p no:cacheprovider --durations=5

echo "== agreement with torch and decode-attention timing"
"$PY" - <<'PY'
import time
import torch
from kvpolicy.backends.base import Backend
from kvpolicy.backends.torch_backend import TorchBackend, _ungrouped, unpack
from kvpolicy.backends.triton_backend import TritonBackend

tb, rb = TritonBackend(), TorchBackend()
assert tb.mode == "compiled"
gen = torch.Generator(device="cuda").manual_seed(0)
codes = diff = meta = deq = deq_eq = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for bits in (2, 4, 8):
        layouts = [("token", 32, 128), ("channel", 32, 128)] + ([("token", 12, 96)] if bits == 2 else [])
        for axis, g, d in layouts:  # each new layout is one JIT compile
            for scale, offset in ((0.01, 0.0), (1.0, 5.0), (30.0, -100.0)):
                x = (torch.randn(4, 8, 256, d, device="cuda", generator=gen) * scale + offset).to(dtype)
                a, r = tb.quantize(x, bits, g, axis), rb.quantize(x, bits, g, axis)
                ca, cr = unpack(a.codes, bits), unpack(r.codes, bits)
                codes += ca.numel(); diff += int((ca != cr).sum())
                meta += int((a.scales != r.scales).sum() + (a.zeros != r.zeros).sum())
                da, dr = tb.dequantize(a), rb.dequantize(r)
                deq += da.numel(); deq_eq += int((da == dr).sum())
print(f"codes compared {codes}, differing {diff}; metadata differing {meta}; dequantized equal {deq_eq}/{deq}")

def exact(p):
    c = unpack(p.codes, p.bits).double()
    return _ungrouped(c * p.scales.double().unsqueeze(-1) + p.zeros.double().unsqueeze(-1), p.axis, p.shape)

for dtype in (torch.float32, torch.float16, torch.bfloat16):
    worst = [0.0] * 4
    for kax, vax in (("channel", "token"), ("token", "token"), ("channel", "channel")):
        for n in (64, 1024, 4096):
            k = (torch.randn(2, 4, n, 128, device="cuda", generator=gen) * 2).to(dtype)
            v = torch.randn(2, 4, n, 128, device="cuda", generator=gen).to(dtype)
            qk, qv = tb.quantize(k, 2, 32, kax), tb.quantize(v, 2, 32, vax)
            q = torch.randn(2, 4, 4, 128, device="cuda", generator=gen) * 2
            o, l = tb.attend(q, qk, qv, 128**-0.5)
            s = (q.double() @ exact(qk).transpose(-1, -2)) * 128**-0.5
            lse, out = torch.logsumexp(s, -1), torch.softmax(s, -1) @ exact(qv)
            ro, rl = Backend.attend(rb, q, qk, qv, 128**-0.5)
            got = ((o.double() - out).abs().max(), (l.double() - lse).abs().max(), (o - ro).abs().max(), (l - rl).abs().max())
            worst = [max(w, float(x)) for w, x in zip(worst, got)]
    print(f"{dtype}: attend vs exact fp64 out {worst[0]:.1e} lse {worst[1]:.1e}; "
          f"vs reference Backend.attend out {worst[2]:.1e} lse {worst[3]:.1e}")

# decode attention over a 2-bit KIVI segment: fused kernel vs dequantize + matmul (interleaved)
for n in (4096, 32768):
    k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.float16, generator=gen)
    qk, qv = tb.quantize(k, 2, 64, "channel"), tb.quantize(v, 2, 64, "token")
    q = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.float16, generator=gen)
    fns = {"triton attend": lambda: tb.attend(q, qk, qv, 0.088), "torch reference attend": lambda: Backend.attend(rb, q, qk, qv, 0.088)}
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            fn(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / 20 * 1e6)
    med = {name: sorted(t)[1] for name, t in times.items()}
    print(f"n={n}: " + ", ".join(f"{name} {us:.0f} us" for name, us in med.items())
          + f" (ratio {med['torch reference attend'] / med['triton attend']:.1f}x)")
PY
echo "== gpu_check_triton: OK"

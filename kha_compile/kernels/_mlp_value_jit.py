"""The @triton.jit kernels behind :mod:`kha_compile.kernels.mlp_value` (see its docstring for the design).

Imported only by ``kha_compile.kernels.mlp_value._kernels`` on first use, after triton is known to be
importable, and loaded once per mode (compiled / ``TRITON_INTERPRET=1``): triton decides between the
two when a ``@triton.jit`` decorator runs, and the interpreter resolves helper calls through module
globals, so the kernels live at module level here rather than in a closure.

Only builtins of ``triton.language`` are used (no ``tl.sigmoid``, ``tl.cdiv``, ``tl.zeros``): those
are themselves ``@triton.jit`` functions, decorated when triton is first imported, so if that import
came before ``TRITON_INTERPRET=1`` was set they are compiled-mode functions that the interpreter
cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel").
"""

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def _probe(x):
    return x


# Compiled for a GPU (not the interpreter, which cannot run PTX): the gate's sigmoid is four PTX
# instructions instead of the ~12 that tl.exp and "/" become (their range checks for denormals and
# huge divisors; both approximations are the same ex2.approx and a reciprocal to 1 ulp).
_PTX = tl.constexpr(isinstance(_probe, JITFunction))
# sigmoid(x) = 1 / (1 + 2^(-x log2 e)), flushing denormals (exact at both ends: 0 and 1)
_SIGMOID_PTX = tl.constexpr(
    "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
    "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }"
)


@triton.jit
def _load_tile(ptr, offs_r, offs_c, stride_r, n_rows, d: tl.constexpr, UPCAST: tl.constexpr):
    # (R, C) tile of a row-major (n_rows, d) matrix, zero outside it; widened to fp32 if UPCAST.
    # Row offsets in int64: M * stride passes 2^31 at M = 16M rows of d = 128.
    mask = (offs_r[:, None] < n_rows) & (offs_c[None, :] < d)
    x = tl.load(ptr + offs_r.to(tl.int64)[:, None] * stride_r + offs_c[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_tile_t(ptr, offs_r, offs_c, d: tl.constexpr, UPCAST: tl.constexpr):
    # (R, C) tile of the transpose of a contiguous (d, d) matrix W: element [r, c] = W[c, r].
    mask = (offs_r[:, None] < d) & (offs_c[None, :] < d)
    x = tl.load(ptr + offs_c[None, :] * d + offs_r[:, None], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _sigmoid(x):
    # x is fp32 (a dot's accumulator)
    if _PTX:
        s = tl.inline_asm_elementwise(_SIGMOID_PTX, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
    return s


@triton.jit
def _round(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    # Round fp32 x to the input dtype, round-to-nearest-even (a GEMM operand or the stored output).
    # UPCAST (interpreter, bf16): the interpreter's fp32 -> bf16 cast truncates, so round by hand on
    # the fp32 bits and stay in fp32 (the value is then exactly representable in bf16).
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = x.to(DTYPE)
    return x


@triton.jit
def _fwd(
    v_ptr,
    wu_ptr,
    wg_ptr,
    wd_ptr,
    y_ptr,
    M,
    stride_vm,
    stride_ym,
    M_BUCKET,
    d: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DTYPE: tl.constexpr = v_ptr.dtype.element_ty
    offs_k = tl.arange(0, D)
    # The weights stay on chip for the whole program: (D, D) each.
    wu = _load_tile(wu_ptr, offs_k, offs_k, d, d, d, UPCAST)
    wg = _load_tile(wg_ptr, offs_k, offs_k, d, d, d, UPCAST)
    wd = _load_tile(wd_ptr, offs_k, offs_k, d, d, d, UPCAST)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(pid, num_tiles, nprog):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        v = _load_tile(v_ptr, offs_m, offs_k, stride_vm, M, d, UPCAST)  # (BLOCK_M, D)
        a = tl.dot(v, wu, input_precision=PRECISION)  # (BLOCK_M, D) fp32
        g = tl.dot(v, wg, input_precision=PRECISION)
        h = _round(2.0 * a * _sigmoid(g), DTYPE, UPCAST)
        y = tl.dot(h, wd, input_precision=PRECISION)
        y = _round(y, DTYPE, UPCAST).to(DTYPE)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < d)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_k[None, :], y, mask=mask)


@triton.jit
def _bwd(
    v_ptr,
    go_ptr,
    wu_ptr,
    wg_ptr,
    wd_ptr,
    gv_ptr,
    ws_ptr,
    M,
    stride_vm,
    stride_gm,
    stride_gvm,
    M_BUCKET,
    d: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DV: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (pid_n, pid_p): column block pid_n of the hidden axis (BLOCK_N wide; the whole
    # axis when COMPUTE_DV), row group pid_p of P, walking row tiles pid_p, pid_p + P, ...
    pid_n = tl.program_id(0)
    pid_p = tl.program_id(1)
    P = tl.num_programs(1)
    DTYPE: tl.constexpr = v_ptr.dtype.element_ty
    offs_k = tl.arange(0, D)  # the full feature axis
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's hidden columns
    wu = _load_tile(wu_ptr, offs_k, offs_n, d, d, d, UPCAST)  # W_up[:, nb]      (D, BLOCK_N)
    wg = _load_tile(wg_ptr, offs_k, offs_n, d, d, d, UPCAST)  # W_gate[:, nb]    (D, BLOCK_N)
    wd_t = _load_tile_t(wd_ptr, offs_k, offs_n, d, UPCAST)  # W_down[nb, :]^T  (D, BLOCK_N)
    acc_u = tl.full((D, BLOCK_N), 0.0, tl.float32)
    acc_g = tl.full((D, BLOCK_N), 0.0, tl.float32)
    acc_d = tl.full((BLOCK_N, D), 0.0, tl.float32)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(pid_p, num_tiles, P):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        v = _load_tile(v_ptr, offs_m, offs_k, stride_vm, M, d, UPCAST)  # (BLOCK_M, D)
        go = _load_tile(go_ptr, offs_m, offs_k, stride_gm, M, d, UPCAST)  # (BLOCK_M, D)
        a = tl.dot(v, wu, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        g = tl.dot(v, wg, input_precision=PRECISION)
        grad_h = tl.dot(go, wd_t, input_precision=PRECISION)
        s = _sigmoid(g)
        h = 2.0 * a * s
        grad_a = _round(2.0 * s * grad_h, DTYPE, UPCAST)
        grad_g = _round(h * (1.0 - s) * grad_h, DTYPE, UPCAST)
        if COMPUTE_DW:
            v_t = tl.trans(v)  # (D, BLOCK_M)
            acc_u += tl.dot(v_t, grad_a, input_precision=PRECISION)
            acc_g += tl.dot(v_t, grad_g, input_precision=PRECISION)
            acc_d += tl.dot(tl.trans(_round(h, DTYPE, UPCAST)), go, input_precision=PRECISION)
        if COMPUTE_DV:  # BLOCK_N == D here: the whole hidden axis is in this program
            gv = tl.dot(grad_a, tl.trans(wu), input_precision=PRECISION)
            gv += tl.dot(grad_g, tl.trans(wg), input_precision=PRECISION)
            gv = _round(gv, DTYPE, UPCAST).to(DTYPE)
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < d)
            tl.store(gv_ptr + offs_m.to(tl.int64)[:, None] * stride_gvm + offs_k[None, :], gv, mask=mask)
    if COMPUTE_DW:
        # workspace (P, 3, d, d) fp32; this program owns [pid_p, 0:2, :, nb] and [pid_p, 2, nb, :]
        base = ws_ptr + pid_p * (3 * d * d)
        m_kn = (offs_k[:, None] < d) & (offs_n[None, :] < d)
        tl.store(base + offs_k[:, None] * d + offs_n[None, :], acc_u, mask=m_kn)
        tl.store(base + d * d + offs_k[:, None] * d + offs_n[None, :], acc_g, mask=m_kn)
        m_nk = (offs_n[:, None] < d) & (offs_k[None, :] < d)
        tl.store(base + 2 * d * d + offs_n[:, None] * d + offs_k[None, :], acc_d, mask=m_nk)


@triton.jit
def _fwd_plugin(
    v_ptr,
    wu_ptr,
    wg_ptr,
    wd_ptr,
    M,
    y_ptr,
    d: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The forward in TensorRT's AOT-plugin calling convention: input pointers, then the scalar
    # arguments, then output pointers. Rows are contiguous (stride d, TensorRT's LINEAR format).
    _fwd(v_ptr, wu_ptr, wg_ptr, wd_ptr, y_ptr, M, d, d, 0, d, D, BLOCK_M, False, PRECISION)

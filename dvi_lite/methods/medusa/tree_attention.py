"""Tree attention for Medusa-style verification: N candidate nodes checked in one forward.

Node i of the candidate tree has a parent `parents[i]` (an index < i, or -1 = child of the last
committed token). It attends to every cached (committed) position and to itself and its ancestors,
never to its siblings or cousins: those are alternative continuations, not context.

Two implementations with one signature:

* `tree_attention_reference`: the dense (N, P + N) boolean mask of `runner.tree_mask` + sdpa. Obviously
  right, and what `Runner` does by default; the mask costs O(N * (P + N)) memory and a host-side loop.
* `tree_attention_triton`: a flash-attention-style Triton kernel that never materialises a mask. It
  streams the past in blocks with an online softmax (every node sees all of it), then the tree keys,
  where "key j is allowed for query i" is decided in registers by walking i's ancestor pointers.
  `Runner(model, attention="triton")` verifies trees with it (through `triton_kernel_for`).

`tree_attention(..., backend="auto")` picks Triton for CUDA tensors when Triton imports, the reference
otherwise. Triton is imported lazily, so this module imports without it (and without a GPU); on a CPU the
kernel runs only under Triton's interpreter, which the tests use: set TRITON_INTERPRET=1 before the first
call into the Triton backend (the kernel is defined then, and Triton decides then whether it is
interpreted). The GPU check is `python -m dvi_lite tree-attention --check` (tree_attention_check.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from dvi_lite.core.runner import tree_depths, tree_mask

__all__ = ["validate_parents", "tree_attention", "tree_attention_reference", "tree_attention_triton",
           "available_backends", "kernel_defined", "triton_kernel_for"]

BACKENDS = ("auto", "torch", "triton")


# ---------------------------------------------------------------------------------------- parents

def validate_parents(parents: torch.Tensor | Sequence[int], require_single_root: bool = False) -> torch.Tensor:
    """Check a tree's parent array and return it as a 1-D int64 tensor (same device as given).

    Convention (the engine's): `parents[i]` is the index of node i's parent, which must come *before*
    i (`-1 <= parents[i] < i`); -1 means "child of the last committed token". That committed token is
    the tree's single root, so several nodes with parent -1 are siblings, not several roots. Requiring
    `parents[i] < i` (a topological order) also rules out self references and cycles, and makes any
    value outside the tree (>= n) an error: every node is reachable from the committed token.

    `require_single_root=True` is for callers whose node 0 *is* the root (e.g. the committed token
    included as a tree node): then only node 0 may have parent -1.

    An empty array (no candidates) is allowed and returns an empty int64 tensor, whatever its dtype
    (`torch.as_tensor([])` is float32). Raises ValueError naming `parents` on any violation.
    """
    if not isinstance(parents, torch.Tensor):
        try:
            parents = torch.as_tensor(parents)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"parents must be a 1-D integer tensor or list of ints, "
                             f"got {type(parents).__name__}: {e}") from e
    if parents.ndim != 1:
        raise ValueError(f"parents must be 1-D (one parent index per tree node), got shape {tuple(parents.shape)}")
    n = parents.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=parents.device)
    if parents.dtype == torch.bool or parents.dtype.is_floating_point or parents.dtype.is_complex:
        raise ValueError(f"parents must have an integer dtype (node indices), got {parents.dtype}")
    par = parents.to(torch.long)
    idx = torch.arange(n, device=par.device)
    bad = (par < -1) | (par >= idx)
    if bool(bad.any()):  # one device sync; then find the first culprit on the host
        i = int(bad.nonzero()[0, 0])
        p = int(par[i])
        if p < -1:
            raise ValueError(f"parents[{i}] = {p} is invalid: values must be >= -1 (-1 = child of the committed token)")
        if p >= n:
            raise ValueError(f"parents[{i}] = {p} refers outside the tree of {n} nodes (a second root?): "
                             f"cycle or forward reference at index {i}; parents must satisfy -1 <= parents[i] < i")
        kind = "self reference" if p == i else "forward reference"
        raise ValueError(f"parents[{i}] = {p} is a {kind}: cycle or forward reference at index {i}; "
                         f"each node's parent must come before it (-1 <= parents[i] < i)")
    if require_single_root:
        roots = (par == -1).nonzero().flatten().tolist()
        if len(roots) > 1:
            raise ValueError(f"parents has several roots (nodes {roots[:8]}{'...' if len(roots) > 8 else ''} have "
                             "parent -1) but require_single_root=True: only node 0 may have parent -1")
    return par


def _max_depth(parents: torch.Tensor) -> int:
    """Longest ancestor chain (edges between a node and its top ancestor); 0 for a star or empty tree."""
    return int(tree_depths(parents.cpu()).max()) if parents.numel() else 0


# ---------------------------------------------------------------------------------------- shapes

def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                  v_new: torch.Tensor, parents: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate shapes up front (a clear ValueError here beats an opaque one from inside sdpa/Triton).

    Returns (B, H, Hkv, N, P, D).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, length, head_dim), got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    B, H, N, D = q.shape
    Bk, Hkv, P, Dk = k_cache.shape
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"k_cache has {Hkv} kv heads; q's {H} heads must be a positive multiple of it (GQA)")
    if (Bk, Dk) != (B, D):
        raise ValueError(f"k_cache must have shape ({B}, Hkv, P, {D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != (B, Hkv, P, D):
        raise ValueError(f"v_cache must have shape {(B, Hkv, P, D)} like k_cache, got {tuple(v_cache.shape)}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (B, Hkv, N, D):
            raise ValueError(f"{name} must have shape (B, Hkv, N, D) = {(B, Hkv, N, D)}, got {tuple(t.shape)}")
    if parents.numel() != N:
        raise ValueError(f"parents has {parents.numel()} entries but q has N = {N} tree nodes")
    dtypes = {t.dtype for t in (q, k_cache, v_cache, k_new, v_new)}
    if len(dtypes) != 1:
        raise ValueError(f"q, k_cache, v_cache, k_new, v_new must share one dtype, got {sorted(map(str, dtypes))}")
    devices = {t.device for t in (q, k_cache, v_cache, k_new, v_new)}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, v_cache, k_new, v_new must be on one device, got {sorted(map(str, devices))}")
    return B, H, Hkv, N, P, D


# ---------------------------------------------------------------------------------------- reference

def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                             v_new: torch.Tensor, parents: torch.Tensor | Sequence[int],
                             scale: float | None = None) -> torch.Tensor:
    """Tree attention the obvious way: dense mask from `runner.tree_mask` + sdpa. Returns (B, H, N, D).

    q (B, H, N, D) are the tree nodes' queries; k_cache/v_cache (B, Hkv, P, D) the committed past;
    k_new/v_new (B, Hkv, N, D) the nodes' own keys/values. GQA as in HF Llama: query head h reads kv
    head h // (H // Hkv). `scale` defaults to 1/sqrt(D).
    """
    par = validate_parents(parents)
    B, H, Hkv, N, P, D = _check_shapes(q, k_cache, v_cache, k_new, v_new, par)
    if N == 0:
        return q.new_empty(B, H, 0, D)
    group = H // Hkv
    k = torch.cat([k_cache, k_new], dim=2).repeat_interleave(group, dim=1)  # (B, H, P + N, D)
    v = torch.cat([v_cache, v_new], dim=2).repeat_interleave(group, dim=1)  # (B, H, P + N, D)
    mask = tree_mask(par.cpu(), P).to(q.device)  # (1, 1, N, P + N) bool, True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, H, N, D)


# ---------------------------------------------------------------------------------------- triton

# lazily filled: {"triton": module, "kernel": jitted fn, "interpret": bool} or {"error": str}
_TRITON: dict[str, Any] = {}


def _load_triton() -> dict[str, Any]:
    """Import triton and define the kernel on first use (so importing this module never needs triton).

    The names are declared global because Triton resolves a kernel's callees and `tl` through the
    function's module globals, not through closures. The kernel calls only `tl` builtins and its own
    jitted helpers, not `tl.max`/`tl.sum`/`tl.zeros`: those are jitted when triton is first imported,
    so if something imported triton before TRITON_INTERPRET=1 was set (transformers does), the
    interpreter cannot call them. Row max/sum go through the builtin `tl.reduce` with the combine
    functions `tl.max`/`tl.sum` themselves use (what the interpreter recognises and runs as one numpy
    call; any other combine function is interpreted element by element, much slower).
    """
    global triton, tl, _max, _add, _MAX_COMBINE, _SUM_COMBINE, _online_update, _tree_attn_kernel
    if _TRITON:
        return _TRITON
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # ImportError, or a broken install
        _TRITON["error"] = f"{type(e).__name__}: {e}"
        return _TRITON

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _add(a, b):
        return a + b

    # private names of triton.language.standard (3.x); our own equivalents if a release renames them
    _MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _max)
    _SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)

    @triton.jit
    def _online_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
        """One flash-attention step: fold scores s (BM, BN) (-inf = masked) and values v (BN, BD) in."""
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX_COMBINE))  # (BM,) row max
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: no inf - inf
        alpha = tl.exp(m_i - m_use)  # (BM,) rescales what was accumulated under the old max
        p = tl.exp(s - m_use[:, None])  # (BM, BN), 0 where masked
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM_COMBINE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (BM, BD)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attn_kernel(Q, Kc, Vc, Kn, Vn, Par, Out,
                          sq_b, sq_h, sq_n, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                          skn_b, skn_h, skn_n, svn_b, svn_h, svn_n, so_b, so_h, so_n,
                          H, N, P, D, max_depth, scale,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One program = BLOCK_M query nodes of one (batch, head). Last dims have stride 1."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hkv = h // GROUP  # GQA: HF's repeat_interleave order
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) query node indices
        offs_n = tl.arange(0, BLOCK_N)  # (BN,)
        offs_d = tl.arange(0, BLOCK_D)  # (BD,)
        m_ok = offs_m < N
        d_ok = offs_d < D
        q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

        # 1) the committed past: every node sees all of it, so no mask beyond the length.
        kc = Kc + b * skc_b + hkv * skc_h
        vc = Vc + b * svc_b + hkv * svc_h
        for start in range(0, P, BLOCK_N):
            kn = start + offs_n
            kv_ok = (kn < P)[:, None] & d_ok[None, :]
            k = tl.load(kc + kn[:, None] * skc_n + offs_d[None, :], mask=kv_ok, other=0.0)  # (BN, BD)
            v = tl.load(vc + kn[:, None] * svc_n + offs_d[None, :], mask=kv_ok, other=0.0)  # (BN, BD)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BM, BN)
            s = tl.where((kn < P)[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, DOT_PRECISION)

        # 2) the tree: ancestors have smaller indices, so keys past this block's last query are never needed.
        kt = Kn + b * skn_b + hkv * skn_h
        vt = Vn + b * svn_b + hkv * svn_h
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            kn = start + offs_n
            kv_ok = (kn < N)[:, None] & d_ok[None, :]
            k = tl.load(kt + kn[:, None] * skn_n + offs_d[None, :], mask=kv_ok, other=0.0)  # (BN, BD)
            v = tl.load(vt + kn[:, None] * svn_n + offs_d[None, :], mask=kv_ok, other=0.0)  # (BN, BD)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BM, BN)
            # allowed[m, n] = key n is on query m's ancestor chain (itself included), found by walking
            # parent pointers; padded rows start at -1 and allow nothing. Never stored anywhere.
            cur = tl.where(m_ok, offs_m, -1)  # (BM,)
            allowed = cur[:, None] == kn[None, :]  # (BM, BN)
            for _ in range(0, max_depth):
                cur = tl.load(Par + cur, mask=cur >= 0, other=-1)
                allowed = allowed | (cur[:, None] == kn[None, :])
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, DOT_PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only padded rows (never stored) can have l == 0
        out = acc / l_safe[:, None]  # (BM, BD)
        tl.store(Out + b * so_b + h * so_h + offs_m[:, None] * so_n + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    # Triton decides interpreted-or-compiled when a kernel is decorated (just above), from TRITON_INTERPRET.
    interpret = type(_tree_attn_kernel).__name__ == "InterpretedFunction"
    _TRITON.update(triton=triton, kernel=_tree_attn_kernel, interpret=interpret)
    return _TRITON


def kernel_defined() -> bool:
    """Whether the Triton kernel was defined already (after that, TRITON_INTERPRET no longer takes effect)."""
    return bool(_TRITON)


def _interpreting() -> bool:
    """Whether our kernel runs under Triton's interpreter (CPU tensors), as fixed when it was defined."""
    return bool(_load_triton().get("interpret", False))


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                          v_new: torch.Tensor, parents: torch.Tensor | Sequence[int],
                          scale: float | None = None) -> torch.Tensor:
    """Same contract as `tree_attention_reference`, computed by a Triton kernel with no mask tensor.

    Needs CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1). fp32 inputs use
    IEEE fp32 dot products (no TF32), so they match the reference to fp32 rounding; fp16/bf16 accumulate in fp32.
    """
    tri = _load_triton()
    if "error" in tri:
        raise RuntimeError(f"triton backend unavailable: {tri['error']}")
    par = validate_parents(parents)
    if not q.is_cuda and not _interpreting():
        raise RuntimeError("tree_attention_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before the "
                           "first call into dvi_lite.methods.medusa.tree_attention's Triton backend, to run the "
                           "kernel on CPU through Triton's interpreter)")
    return _launch(q, k_cache, v_cache, k_new, v_new, par, _max_depth(par), scale)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
            par: torch.Tensor, depth: int, scale: float | None) -> torch.Tensor:
    """Run the kernel on a validated parent array `par` (N,) whose longest ancestor chain is `depth`."""
    tri = _load_triton()
    B, H, Hkv, N, P, D = _check_shapes(q, k_cache, v_cache, k_new, v_new, par)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, H, N, D)
    if N == 0 or B * H == 0 or D == 0:
        return out
    q, k_cache, v_cache, k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q, k_cache, v_cache, k_new, v_new))
    if P == 0:  # an empty tensor may have no storage; hand the kernel a valid pointer it never reads
        k_cache, v_cache = k_new, v_new
    par32 = par.to(device=q.device, dtype=torch.int32)  # a no-op when the caller prepared it so
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    triton = tri["triton"]
    block_m = min(64, max(16, triton.next_power_of_2(N)))  # tl.dot needs every dim >= 16
    block_d = max(16, triton.next_power_of_2(D))
    # Wide rows (fp32 with D = 128, fp16 with D = 256) halve the key block and the pipeline depth, so
    # shared memory stays < 100 KB (64/64/3 stages would need ~180 KB for fp32 D = 128: too much on A100).
    wide = q.element_size() * block_d > 256
    block_n = 32 if wide else 64
    grid = (triton.cdiv(N, block_m), B * H)
    tri["kernel"][grid](
        q, k_cache, v_cache, k_new, v_new, par32, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H, N, P, D, depth, scale,
        GROUP=H // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2 if wide else 3,
    )
    return out


def triton_kernel_for(device: torch.device | str) -> Callable[[torch.Tensor], Callable[..., torch.Tensor]]:
    """The Triton backend of `Runner(model, attention="triton")`, which names it by a string (the core imports
    no method module): checks once that the kernel can run on `device`, so a missing triton or GPU is an error
    when the runner is built, not mid-decoding. Returns `prepare(parents)`: it validates a tree once per
    forward (validation and the depth need host syncs) and returns the tree's attention function
    `attend(q, k_cache, v_cache, k_new, v_new, scale) -> (B, H, N, D)`, which every layer then calls."""
    tri = _load_triton()
    if "error" in tri:
        raise RuntimeError(f"attention='triton' needs triton, which does not import here: {tri['error']}")
    if torch.device(device).type != "cuda" and not tri["interpret"]:
        raise RuntimeError(f"attention='triton' needs a CUDA model (this one is on {device}); on CPU the kernel runs "
                           "only in Triton's interpreter, for tests: set TRITON_INTERPRET=1 before the kernel is "
                           "first defined")

    def prepare(parents: torch.Tensor) -> Callable[..., torch.Tensor]:
        par = validate_parents(parents)
        depth = _max_depth(par)
        par32 = par.to(torch.int32)
        return lambda q, k_cache, v_cache, k_new, v_new, scale=None: _launch(q, k_cache, v_cache, k_new, v_new,
                                                                           par32, depth, scale)
    return prepare


# ---------------------------------------------------------------------------------------- dispatch

def available_backends() -> list[str]:
    """Backends that can run here: "torch" always; "triton" when triton imports and a GPU or the interpreter
    is there."""
    out = ["torch"]
    if "error" not in _load_triton() and (torch.cuda.is_available() or _interpreting()):
        out.append("triton")
    return out


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, parents: torch.Tensor | Sequence[int], scale: float | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """Tree attention, (B, H, N, D). backend: "torch" (dense mask + sdpa), "triton" (mask-free kernel) or
    "auto" = triton for CUDA tensors when triton imports, torch otherwise (also on CPU under the interpreter:
    interpreting is for tests, not speed)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if (isinstance(q, torch.Tensor) and q.is_cuda and "error" not in _load_triton()) else "torch"
    fn = tree_attention_triton if backend == "triton" else tree_attention_reference
    return fn(q, k_cache, v_cache, k_new, v_new, parents, scale)

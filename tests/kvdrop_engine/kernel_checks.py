"""Checks of ``kvdrop_engine.kernels`` run by ``test_kernels.py`` in a child process started with
``TRITON_INTERPRET=1`` (Triton reads it at import). Exits non-zero and names the failed check.

Not collected by pytest on its own (no ``test_`` prefix)."""

from __future__ import annotations

import sys

import torch


def _patch_interpreter() -> None:
    """Triton's interpreter keeps scalars as 1-element arrays and converts them with ``int()``,
    which NumPy >= 2.4 refuses for arrays that are not 0-d; convert through ``reshape(-1)[0]``."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def reference(q, kc, vc, table, lens):  # type: ignore[no-untyped-def]
    """Attention in float64, one sequence at a time, K/V gathered through the block table."""
    bsz, hq, d = q.shape
    _, bs, hkv, _ = kc.shape
    out = torch.empty(bsz, hq, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(lens[b])
        nb = -(-n // bs)
        k = kc[table[b, :nb].long()].reshape(-1, hkv, d)[:n].double()
        v = vc[table[b, :nb].long()].reshape(-1, hkv, d)[:n].double()
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * d**-0.5).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


def check_paged_decode(failures: list[str]) -> None:
    from kvdrop_engine import kernels

    gen = torch.Generator().manual_seed(0)
    cases = [  # (batch, q heads, kv heads, head dim, block size, lengths)
        (3, 8, 2, 16, 4, [1, 37, 70]),
        (2, 9, 3, 32, 16, [130, 16]),
        (2, 4, 4, 16, 8, [8, 9]),
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for bsz, hq, hkv, d, bs, lens in cases:
            nblk = 40
            kc = torch.randn(nblk, bs, hkv, d, generator=gen).to(dtype)
            vc = torch.randn(nblk, bs, hkv, d, generator=gen).to(dtype)
            q = torch.randn(bsz, hq, d, generator=gen).to(dtype)
            width = max(-(-n // bs) for n in lens) + 1  # one unused column past the longest
            table = torch.stack([torch.randperm(nblk, generator=gen)[:width] for _ in lens])
            table = table.to(torch.int32)
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            ref = reference(q, kc, vc, table, seq_lens)
            for splits in (1, 3, 8):
                out = torch.full_like(q, float("nan"))
                kernels.paged_decode(q, kc, vc, table, seq_lens, splits=splits, block_n=16, out=out)
                err = float((out.double() - ref).norm() / ref.norm())
                if not err < tol:  # NaN (an unwritten row) fails too
                    failures.append(
                        f"paged_decode {dtype} {bsz}x{hq}/{hkv}x{d} bs{bs} {lens} "
                        f"splits={splits}: relative error {err:.2e}"
                    )


def check_fused_ops(failures: list[str]) -> None:
    from kvdrop_engine import kernels
    from kvdrop_engine.model import RMSNorm

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        for rows, dim in ((5, 300), (3, 64)):
            x = torch.randn(rows, dim, generator=gen).to(dtype)
            norm = RMSNorm(dim, 1e-6).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(dim, generator=gen))
            diff = (kernels.rms_norm(x, norm.weight, 1e-6).float() - norm(x).float()).abs().max()
            if not diff <= 2e-3 * norm(x).float().abs().max():
                failures.append(f"rms_norm {dtype} {rows}x{dim}: max difference {float(diff)}")
            g = torch.randn(rows, 2 * dim, generator=gen).to(dtype)[:, :dim]  # strided rows
            u = torch.randn(rows, dim, generator=gen).to(dtype)
            want = torch.nn.functional.silu(g) * u
            diff = (kernels.silu_mul(g, u).float() - want.float()).abs().max()
            if not diff <= 2e-3 * want.float().abs().max():
                failures.append(f"silu_mul {dtype} {rows}x{dim}: max difference {float(diff)}")


def check_paged_attention_step(failures: list[str]) -> None:
    """A mixed step (prefill chunks + decodes) through the kernel equals the PyTorch path."""
    from kvdrop_engine import paged
    from kvdrop_engine.paged import PagedAttention, PagedKVCache, SeqStep

    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=16, num_blocks=32, block_size=4)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    seqs = [
        SeqStep("a", list(range(0, 8)), 9, 1),
        SeqStep("b", list(range(8, 16)), 20, 5),
        SeqStep("c", list(range(16, 24)), 0, 1),
        SeqStep("d", list(range(24, 32)), 30, 1),
    ]
    q = torch.randn(8, 6, 16, generator=gen)
    k = torch.randn(8, 2, 16, generator=gen)
    v = torch.randn(8, 2, 16, generator=gen)
    saved = cache.k.clone(), cache.v.clone()
    with_kernel = PagedAttention(cache, seqs)
    if with_kernel._kernel is None:
        failures.append("PagedAttention did not use the kernel under the interpreter")
        return
    got = with_kernel(0, q, k, v)
    cache.k.copy_(saved[0])
    cache.v.copy_(saved[1])
    original = paged.use_kernel
    paged.use_kernel = lambda c: False
    try:
        want = PagedAttention(cache, seqs)(0, q, k, v)
    finally:
        paged.use_kernel = original
    diff = float((got - want).abs().max())
    if not diff < 1e-5:
        failures.append(f"PagedAttention kernel vs PyTorch path: max difference {diff}")


def main() -> int:
    from kvdrop_engine import kernels

    if not kernels.interpreted():
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _patch_interpreter()
    failures: list[str] = []
    for check in (check_paged_decode, check_fused_ops, check_paged_attention_step):
        before = len(failures)
        check(failures)
        print(f"{check.__name__}: {'ok' if len(failures) == before else 'FAILED'}", flush=True)
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Checks of ``kvdrop.kernels`` run by ``test_kernels.py`` in a child process started with
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


def reference_row_max(kn16: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    s = kn16.double() @ kn16.double()[:, c0:c1].transpose(1, 2)  # [H, T, c1 - c0]
    rows = torch.arange(kn16.shape[1])[:, None]
    s[:, rows == torch.arange(c0, c1)[None, :]] = -torch.inf
    return s.amax(dim=-1).float()


def check_row_max() -> None:
    """Entries in {-1, 0, 1} / 4: every product and sum is exact in float16 and float32, so the
    kernel must equal the float64 reference bit for bit (masking, ranges, tails)."""
    from kvdrop.kernels import available, similarity_row_max

    gen = torch.Generator().manual_seed(0)
    for heads, tokens, dim, c0, c1 in [
        (3, 300, 64, 0, 300),
        (2, 130, 16, 70, 129),
        (1, 70, 32, 5, 9),
    ]:
        kn16 = (torch.randint(-1, 2, (heads, tokens, dim), generator=gen) / 4).half()
        assert available(kn16)
        got = similarity_row_max(kn16, c0, c1)
        ref = reference_row_max(kn16, c0, c1)
        assert torch.equal(got, ref), (heads, tokens, dim, c0, c1, (got - ref).abs().max())
    one = torch.zeros(1, 1, 16, dtype=torch.float16)
    assert similarity_row_max(one, 0, 1).item() == float("-inf")  # only the diagonal
    assert not available(torch.zeros(1, 4, 24, dtype=torch.float16))  # d not a power of two
    print("row_max: ok")


def check_redundancy_with_the_kernel() -> None:
    """key_redundancy's all-rows scan with the kernel as its filter equals the quadratic form."""
    from kvdrop.attention import key_redundancy, unit_keys

    gen = torch.Generator().manual_seed(3)
    centres = torch.randn(2, 3, 32, generator=gen)
    which = torch.randint(0, 3, (2, 150), generator=gen)
    k = torch.gather(centres, 1, which[..., None].expand(2, 150, 32)) + 0.6 * torch.randn(
        2, 150, 32, generator=gen
    )
    kn = k.double() / (k.double().norm(dim=-1, keepdim=True) + 1e-8)
    for threshold in (0.5, -0.2):
        sim = kn @ kn.transpose(1, 2)
        for h in range(2):
            sim[h].fill_diagonal_(0.0)
        idx = torch.where(
            sim > threshold, torch.arange(150), torch.zeros_like(sim, dtype=torch.long)
        )
        last = idx.max(dim=-1).values
        for h in range(2):
            sim[h, torch.arange(150), last[h]] = 0.0
        ref = torch.softmax(sim.mean(dim=1), dim=-1)
        got = key_redundancy(unit_keys(k), threshold, col_block=64, all_rows=True)
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (threshold, err)
    print("redundancy with the kernel: ok")


def main() -> int:
    _patch_interpreter()
    from kvdrop import kernels

    if not kernels.interpreted():
        print("TRITON_INTERPRET=1 was not set when Triton was imported")
        return 2
    for check in (check_row_max, check_redundancy_with_the_kernel):
        try:
            check()
        except Exception as exc:  # report which check failed
            print(f"{check.__name__}: FAILED: {exc!r}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why the in-kernel x split tried in bench/mx_f8_gluon.py (removed) gave wrong outputs: a
chunk's hi/lo e4m3 parts computed as it did (hi = v.to(e4m3), lo = (v - hi.to(fp32)).to(e4m3))
and written (a) straight to global, (b) through the NVMMA-swizzled shared buffer and back,
(c) hi alone, (d) joined as uint8; each compared with torch. One GPU call (Triton 3.6):

    python bench/gluon_fp8_split_diag.py

Found (bench/results/mx_f8_gluon_probe.md): hi is right; lo is wrong at k % 4 in {0, 1}, in
every path, so the fp8 -> fp32 upcast of hi (cvt e4m3x2 -> f16x2 on pairs) is what goes wrong
in this layout (8 consecutive k a thread), not the join / permute / reshape or the store."""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared


@gluon.jit
def split_kernel(x_ptr, direct_ptr, via_ptr, hi_ptr, u8_ptr, M, stride_xm, MP: gl.constexpr,
                 num_warps: gl.constexpr):
    NX: gl.constexpr = 2 * MP
    x3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // (4 * min(MP, 8)), min(MP, 8), 4],
                                        [4, 1, 1], [2, 1, 0])
    xb = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, x3)))
    xm = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(2, x3)))
    xk = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, x3)))
    ptrs = x_ptr + (xm * stride_xm)[None, :, None] + (xb * 32)[:, None, None] + xk[None, None, :]
    ok = (xm < M)[None, :, None] & (xb < 16)[:, None, None]
    v = gl.load(ptrs, mask=ok, other=0.0).to(gl.float32)
    hi = v.to(gl.float8e4nv)
    lo = (v - hi.to(gl.float32)).to(gl.float8e4nv)
    parts = gl.reshape(gl.permute(gl.join(hi, lo), (0, 3, 1, 2)), (16 * NX, 32))
    # (c) hi alone, in the load's layout: [16, MP, 32] -> hi_ptr[blk, m, k]
    gl.store(hi_ptr + ((xb * MP)[:, None, None] + xm[None, :, None]) * 32 + xk[None, None, :],
             hi.to(gl.uint8, bitcast=True))
    # (d) the same join / permute / reshape on the bytes as uint8
    hi8, lo8 = hi.to(gl.uint8, bitcast=True), lo.to(gl.uint8, bitcast=True)
    u8 = gl.reshape(gl.permute(gl.join(hi8, lo8), (0, 3, 1, 2)), (16 * NX, 32))
    ur = gl.arange(0, 16 * NX, layout=gl.SliceLayout(1, u8.type.layout))
    uc = gl.arange(0, 32, layout=gl.SliceLayout(0, u8.type.layout))
    gl.store(u8_ptr + ur[:, None] * 32 + uc[None, :], u8)
    # (a) straight to global, in parts' own layout
    pr = gl.arange(0, 16 * NX, layout=gl.SliceLayout(1, parts.type.layout))
    pc = gl.arange(0, 32, layout=gl.SliceLayout(0, parts.type.layout))
    gl.store(direct_ptr + pr[:, None] * 32 + pc[None, :], parts.to(gl.uint8, bitcast=True))
    # (b) through the swizzled shared buffer
    xs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8,
                                                   rank=2)
    smem = gl.allocate_shared_memory(gl.float8e4nv, [16 * NX, 32], xs_layout)
    smem.store(parts)
    fence_async_shared()
    gl.thread_barrier()
    bl: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    back = smem.load(bl)
    br = gl.arange(0, 16 * NX, layout=gl.SliceLayout(1, bl))
    bc = gl.arange(0, 32, layout=gl.SliceLayout(0, bl))
    gl.store(via_ptr + br[:, None] * 32 + bc[None, :], back.to(gl.uint8, bitcast=True))


def main():
    torch.manual_seed(0)
    for mp, m in ((4, 1), (4, 4), (8, 5)):
        nx = 2 * mp
        x = (torch.randn(m, 512, device="cuda") * 100).to(torch.bfloat16)
        direct = torch.zeros(16 * nx, 32, dtype=torch.uint8, device="cuda")
        via = torch.zeros_like(direct)
        hi_out = torch.zeros(16, mp, 32, dtype=torch.uint8, device="cuda")
        u8 = torch.zeros_like(direct)
        split_kernel[(1,)](x, direct, via, hi_out, u8, m, x.stride(0), MP=mp, num_warps=4)
        v = torch.zeros(mp, 512, device="cuda")
        v[:m] = x.float()
        hi = v.to(torch.float8_e4m3fn)
        lo = (v - hi.float()).to(torch.float8_e4m3fn)
        ref = torch.stack([hi, lo]).view(torch.uint8)  # [2, MP, 512]
        ref = ref.view(2, mp, 16, 32).permute(2, 0, 1, 3).reshape(16 * nx, 32)
        hi_ref = hi.view(torch.uint8).view(mp, 16, 32).permute(1, 0, 2)
        bad = (hi_out != hi_ref).nonzero()
        print(f"MP={mp} M={m} hi alone: {len(bad)} of {hi_ref.numel()} bytes differ",
              bad[:6].tolist() if len(bad) else "")
        for name, got in (("direct", direct), ("via smem", via), ("uint8 join", u8)):
            bad = (got != ref).nonzero()
            print(f"MP={mp} M={m} {name}: {len(bad)} of {ref.numel()} bytes differ",
                  bad[:6].tolist() if len(bad) else "")
            if len(bad):
                r = bad[0, 0].item()
                print("   row", r, "got", got[r, :8].tolist(), "want", ref[r, :8].tolist())
    sys.stdout.flush()


if __name__ == "__main__":
    main()

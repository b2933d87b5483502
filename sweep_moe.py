"""Scratch: fused_experts launch configs at V2-Lite and V3 shapes."""
import itertools, json, os, torch
from pagedmla.kernel_bench import bench, graphed
from pagedmla.ops.triton.moe import MoEConfig, fused_experts, pick_config
gen = torch.Generator().manual_seed(0)
res = []
for name, (E, k, H, I, Ts) in {"V2-Lite": (64, 6, 2048, 1408, (16, 128, 4096)), "V3": (256, 8, 7168, 2048, (128,))}.items():
    w13 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16()
    for T in Ts:
        x = torch.randn(T, H, generator=gen).bfloat16().cuda()
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
        w = torch.rand(T, k, generator=gen).cuda()
        base = pick_config(T * k, E)
        bms = (64, 128) if T >= 1024 else (16, 32)
        best = None
        for bm, bn, bk, nw, ns in itertools.product(bms, (64, 128), (64, 128), (4, 8), (3, 4)):
            if bm * bk + bn * bk > 32768 and ns == 4: continue
            c = MoEConfig(bm, bn, bk, nw, ns)
            try:
                us = bench(graphed(lambda c=c: fused_experts(x, w13, w2, w, ids, config=c)), rep_ms=30)
            except Exception as e:
                continue
            res.append({"shape": name, "T": T, "cfg": [bm, bn, bk, nw, ns], "us": us})
            if best is None or us < best[0]: best = (us, c)
        d = bench(graphed(lambda: fused_experts(x, w13, w2, w, ids)), rep_ms=50)
        print(f"{name} T={T}: default {base} {d:.1f} us; best {best[1]} {best[0]:.1f} us", flush=True)
    del w13, w2; torch.cuda.empty_cache()
json.dump(res, open(os.environ["OUT"] + "/sweep_moe.json", "w"))

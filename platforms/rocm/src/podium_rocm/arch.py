"""What Podium needs to know about an AMD GPU architecture, keyed by its gfx name.

torch on ROCm reports the architecture as ``torch.cuda.get_device_properties(i).gcnArchName``,
e.g. ``"gfx942:sramecc+:xnack-"`` (MI300X/MI300A/MI325X); the part before the first ``:`` is the
gfx name. The facts here become the platform's capabilities and pick its kernel tuning, so the
core never asks which vendor or chip it runs on.

fp8 flavour: CDNA3 (gfx940/941/942) implements the "fnuz" fp8 formats (no negative zero, one NaN,
exponent bias 8: ``torch.float8_e4m3fnuz``); CDNA4 (gfx950, MI350) and RDNA4 (gfx12) implement
the OCP formats that NVIDIA uses (``torch.float8_e4m3fn``); older chips have no fp8 matrix units.
Wavefront: CDNA (Instinct) runs 64-lane wavefronts, RDNA (Radeon) 32-lane ones, so one Triton
"warp" is 64 or 32 threads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AmdArch:
    """One AMD GPU architecture: gfx name, family, wavefront size, fp8 flavour (None: no fp8)."""

    gfx: str
    family: str
    wavefront_size: int
    fp8: str | None

    @property
    def is_cdna(self) -> bool:
        return self.family.startswith("cdna")


# exact gfx names first, then prefixes (longest first) for families with many steppings
_EXACT = {
    "gfx908": ("cdna1", 64, None),  # MI100
    "gfx90a": ("cdna2", 64, None),  # MI200 series
    "gfx940": ("cdna3", 64, "e4m3fnuz"),
    "gfx941": ("cdna3", 64, "e4m3fnuz"),
    "gfx942": ("cdna3", 64, "e4m3fnuz"),  # MI300X, MI300A, MI325X
    "gfx950": ("cdna4", 64, "e4m3fn"),  # MI350 series
}
_PREFIXES = (
    ("gfx12", ("rdna4", 32, "e4m3fn")),
    ("gfx11", ("rdna3", 32, None)),
    ("gfx10", ("rdna", 32, None)),
)


def parse_arch(gcn_arch_name: str | None) -> AmdArch | None:
    """``"gfx942:sramecc+:xnack-"`` -> AmdArch(gfx942, cdna3, 64, e4m3fnuz); None for None/empty.

    An unrecognised gfx name gets family "unknown", 64-lane wavefronts and no fp8: the kernels stay
    correct (tuning only changes speed) and fp8 is not claimed for hardware we know nothing of.
    """
    if not gcn_arch_name:
        return None
    gfx = gcn_arch_name.split(":", 1)[0].strip().lower()
    facts = _EXACT.get(gfx)
    if facts is None:
        facts = next((f for prefix, f in _PREFIXES if gfx.startswith(prefix)), ("unknown", 64, None))
    family, wavefront_size, fp8 = facts
    return AmdArch(gfx, family, wavefront_size, fp8)


# The architecture the ROCm tuning table is written for; also what the test-only switch that runs
# this plugin on an NVIDIA GPU pretends to be (see detection.py).
TARGET_ARCH = parse_arch("gfx942")

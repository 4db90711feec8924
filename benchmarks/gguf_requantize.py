"""A GGUF file's quantized weights re-quantized to another block format, for benchmarks of the kept-quantized
kernels on formats the embedded SmolLM2 file does not use:

    python benchmarks/gguf_requantize.py Q8_0 /tmp/smollm2-q8_0.gguf [--source FILE]

Every tensor stored in a quantized format (not the float32 norms) is dequantized with gguf-py and written
in the target format where its rows allow: Q8_0 and Q4_1 by gguf-py's own quantizers, Q4_K by the simple
one below (round to nearest, each sub-block's scale and minimum from its range; llama.cpp searches for
better ones, which changes the values, not the kernels' work). Rows that a format cannot hold whole
(SmolLM2's 576 columns are not whole 256-weight Q4_K blocks: llama.cpp stores those as Q5_0) keep their
original blocks. Needs gguf-py (``pip install gguf``), a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FORMATS = ("Q8_0", "Q4_1", "Q4_K")


def _divide(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    """values / by, 0 where ``by`` is 0 (an all-zero sub-block)."""
    return np.where(by > 0, values / np.where(by > 0, by, 1), 0)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> uint8 [rows, columns // 256 * 144] Q4_K blocks:
    w = d sc_j q - dmin m_j per sub-block j of 32, q in 0..15, sc_j and m_j 6-bit, d and dmin fp16."""
    rows, columns = values.shape
    x = values.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-block, weight]
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / 15  # [blocks, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_divide(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(-low, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc  # [blocks, 8]
    shift = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint(_divide(x + shift[..., None], step[..., None])), 0, 15).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), dtype=np.uint8)  # k_scale_min's layout
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    nibbles = q.reshape(-1, 4, 2, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high) share 32 bytes
    qs = (nibbles[:, :, 0] | nibbles[:, :, 1] << 4).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], 1)
    return blocks.reshape(rows, columns // 256 * 144)


def requantize(source: Path, target: Path, fmt: str) -> dict[str, int]:
    """Write ``target``: ``source`` with its quantized tensors in ``fmt`` where their rows allow; returns
    {ggml type name: tensors} of the result."""
    import gguf
    from gguf.quants import dequantize, quantize

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    wanted = gguf.GGMLQuantizationType[fmt]
    block_weights = gguf.GGML_QUANT_SIZES[wanted][0]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        quantized = kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        columns = int(tensor.shape[0])  # gguf-py lists the row length first
        if quantized and kind != wanted and columns % block_weights == 0:
            values = dequantize(data, kind).astype(np.float32)
            data = quantize_q4_k(values) if fmt == "Q4_K" else quantize(values, wanted)
            kind = wanted
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=kind)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("target", type=Path)
    parser.add_argument("--source", type=Path, default=None, help="default: the embedded SmolLM2 file")
    args = parser.parse_args()
    if args.source is None:
        from podium.loader import embedded_gguf_path

        args.source = embedded_gguf_path()
    print(requantize(args.source, args.target, args.format))


if __name__ == "__main__":
    main()

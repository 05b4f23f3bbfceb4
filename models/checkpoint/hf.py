"""Reader for a Hugging Face model folder: config.json, generation_config.json and safetensors (one file, or shards
listed by model.safetensors.index.json).

FP8 checkpoints (config.json's quantization_config with quant_method "fp8" or "compressed-tensors" float8, as vLLM,
llm-compressor and the vendors' `-FP8` releases write them): each float8_e4m3fn (or e5m2) `<name>.weight` comes with a
`<name>.weight_scale` (one per tensor, or per output channel (out,) / (out, 1)) or a `<name>.weight_scale_inv` (one per
block of weight_block_size, e.g. 128 x 128), and optionally a static activation `<name>.input_scale`. They are
dequantized to the load dtype as they are read (w * scale, one log line says so); input scales are dropped, since the
activations stay in the compute dtype. `--quantize fp8` stores the dequantized weights as kiln's fp8 format again.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from kiln.models.checkpoint.convert import build_weights
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import Weights

log = logging.getLogger("kiln.models")
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}  # safetensors dtype -> numpy
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"{path} does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path} is not valid JSON ({e.__class__.__name__} at {getattr(e, 'pos', '?')}).") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path} does not hold a JSON object.")
    return data


def load_config(folder: Path) -> ModelConfig:
    """ModelConfig of an HF folder; generation_config.json's eos_token_id wins over config.json's."""
    hf = read_json(folder / "config.json")
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        for key in ("eos_token_id", "bos_token_id"):
            if gen.get(key) is not None:
                hf[key] = gen[key]
    return ModelConfig.from_hf(hf)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise KilnError(f"{index} has no weight_map.")
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise KilnError(f"{index} names the shard {f.name}, which is missing.")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise KilnError(f"{folder} holds no model.safetensors (nor shards with model.safetensors.index.json).")


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header {name: {dtype, shape, data_offsets}} and the offset its data starts at."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _read_fp8(path: Path, info: dict, start: int) -> np.ndarray:
    """One float8 tensor read from its bytes (safetensors' numpy reader has no float8 dtypes)."""
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, FP8_DTYPES[info["dtype"]]).reshape(info["shape"])


def iter_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of every shard, in HF layout; float8 tensors as ml_dtypes float8 arrays."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="numpy") as f:
                header, start = _header(path)
                for name in f.keys():
                    info = header.get(name, {})
                    yield (
                        name,
                        (_read_fp8(path, info, start) if info.get("dtype") in FP8_DTYPES else f.get_tensor(name)),
                    )
        except (SafetensorError, OSError, ValueError, struct.error) as e:
            raise KilnError(f"{path} is not a readable safetensors file (corrupt or truncated: {e}).") from None


def fp8_scheme(hf_config: dict, folder: Path) -> dict | None:
    """The FP8 quantization of a checkpoint ({"method", "block"}), None for a float one; another quantization method
    is a one-sentence error."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "unknown")
    if method == "fp8":
        return {"method": method, "block": tuple(qc.get("weight_block_size") or ()) or None}
    if method == "compressed-tensors" and "float" in json.dumps(qc.get("config_groups", {})):
        return {"method": method, "block": None}
    raise KilnError(
        f"{folder} is quantized with {method}; kiln reads float and FP8 checkpoints (or GGUF files), so use the "
        "unquantized release or a GGUF of it."
    )


def _fp8_table(dtype) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of a float8 dtype (a lookup widens fast; numpy's cast does
    not)."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def dequantize_fp8(w: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None, name: str) -> np.ndarray:
    """A float8 weight (out, in) times its scale, as float32: one scale for the tensor, one per output channel ((out,)
    or (out, 1)), or one per block of rows x columns ((ceil(out / bo), ceil(in / bi)), the block from
    weight_block_size or inferred from the shapes)."""
    w32 = _fp8_table(w.dtype)[w.view(np.uint8)]  # (out, in)
    s = np.asarray(scale, np.float32)
    out, k = w.shape
    if s.size == 1:
        return w32 * s.reshape(())
    if s.size == out and s.shape in ((out,), (out, 1)):
        return w32 * s.reshape(out, 1)
    if s.ndim == 2:
        bo, bi = block or (-(-out // s.shape[0]), -(-k // s.shape[1]))
        if s.shape == (-(-out // bo), -(-k // bi)):
            return w32 * np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :k]
    raise KilnError(
        f"The FP8 tensor {name} has a scale of shape {s.shape}, which is neither per tensor, per channel nor per block "
        f"of its {w.shape} weight."
    )


def iter_dequantized(folder: Path, scheme: dict, dtype) -> Iterator[tuple[str, np.ndarray]]:
    """iter_tensors with every float8 weight dequantized by its scale (read from whichever shard holds it), the
    scales and input scales dropped; one log line when done."""
    scales: dict[str, Path] = {}  # scale name -> its shard
    for path in safetensors_files(folder):
        scales.update({n: path for n in _header(path)[0] if n.endswith(SCALE_SUFFIXES)})
    fp8 = inputs = 0
    for name, array in iter_tensors(folder):
        if name.endswith(SCALE_SUFFIXES):
            inputs += name.endswith(".input_scale")
            continue
        if array.dtype in FP8_DTYPES.values():
            scale_name = next((n for n in (f"{name}_scale", f"{name}_scale_inv") if n in scales), None)
            if scale_name is None:
                raise KilnError(f"The FP8 tensor {name} in {folder} has no {name}_scale (nor _scale_inv).")
            with safe_open(str(scales[scale_name]), framework="numpy") as f:
                array = dequantize_fp8(array, f.get_tensor(scale_name), scheme["block"], name)
            fp8 += 1
        yield name, array
    block = f", {scheme['block'][0]}x{scheme['block'][1]} blocks" if scheme["block"] else ""
    dropped = f"; {inputs} static input scales dropped (activations stay in {jnp.dtype(dtype).name})" if inputs else ""
    log.info("FP8 checkpoint (%s%s): %d float8 weights dequantized to %s at load%s",
             scheme["method"], block, fp8, jnp.dtype(dtype).name, dropped)  # fmt: skip


def load(folder: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, Weights]:
    """Config and weights (numpy leaves in `dtype`) of an HF folder (an FP8 one dequantized, see the module doc)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KilnError(f"The model folder {folder} does not exist.")
    cfg = load_config(folder)
    scheme = fp8_scheme(read_json(folder / "config.json"), folder)
    tensors = iter_tensors(folder) if scheme is None else iter_dequantized(folder, scheme, dtype)
    return cfg, build_weights(cfg, tensors, dtype=dtype, source=str(folder))

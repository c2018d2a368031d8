"""Where weights come from: a Hugging Face directory (safetensors) or a GGUF file.

Both sources hand out tensors by their HF name in the HF layout, so one declared table
(`ParamSpec`) maps either onto the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jfire.checkpoint.paths import WEIGHT_INDEX, read_weight_map
from jfire.errors import JfireError
from jfire.models.params import ParamSpec
from jfire.models.registry import config_from_gguf, config_from_hf


class HFDirSource:
    """A HF model directory: config.json plus model.safetensors or a sharded index."""

    def __init__(self, path: Path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise JfireError(f"{self.path} has no config.json; a Hugging Face model directory needs one")
        try:
            self.hf_config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise JfireError(f"{config_file} is not valid JSON: {e}") from None
        # A config.json that is not an object, lacks a required key or holds a value of the wrong
        # type would otherwise escape from_hf as a bare KeyError/TypeError with a traceback.
        if not isinstance(self.hf_config, dict):
            raise JfireError(f"{config_file} must hold a JSON object, not a {type(self.hf_config).__name__}")
        try:
            self.config = config_from_hf(self.hf_config)
        except JfireError:
            raise
        except KeyError as e:
            raise JfireError(f"{config_file} lacks the required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise JfireError(f"{config_file} has a value of the wrong type ({e})") from None
        self._file_of = self._index()
        self._open: dict[Path, object] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def _index(self) -> dict[str, Path]:
        if (self.path / WEIGHT_INDEX).is_file():
            return read_weight_map(self.path)
        single = self.path / "model.safetensors"
        if single.is_file():
            return {name: single for name in _safetensors_names(single)}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise JfireError(
                f"{self.path} has no *.safetensors weights (pytorch .bin files are not read; "
                "convert them to safetensors first)"
            )
        return {name: f for f in files for name in _safetensors_names(f)}

    def get(self, name: str, spec: ParamSpec) -> np.ndarray:
        file = self._file_of.get(name)
        if file is None:
            raise JfireError(f"{self.path}: tensor '{name}' is missing (expected shape {spec.source_shape})")
        try:
            from safetensors import safe_open

            if file not in self._open:
                self._open[file] = safe_open(file, framework="numpy")
            raw_dtype = _NON_NUMPY_DTYPES.get(self._header(file)[name]["dtype"])
            tensor = self._raw(file, name, raw_dtype) if raw_dtype else self._open[file].get_tensor(name)
            if f"{name}_scale_inv" in self._file_of and spec.dtype != "float8_e4m3fn":
                # DeepSeek-V3's FP8 weights, block-scaled: read as the real values they stand for
                # (unless the param keeps them FP8, beside its own scales).
                from jfire.checkpoint.fp8 import dequantize_fp8_block

                return dequantize_fp8_block(tensor, self.get(f"{name}_scale_inv", spec))
            return tensor
        except JfireError:
            raise
        except Exception as e:  # safetensors reports truncation as a bare error string
            raise JfireError(
                f"{file.name}: cannot read tensor '{name}' ({e}); the file may be truncated or corrupt"
            ) from None

    def _header(self, file: Path) -> dict:
        """The safetensors header of `file` (names -> dtype, shape, byte offsets)."""
        if file not in self._headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (json.loads(f.read(size)), 8 + size)
        return self._headers[file][0]

    def _raw(self, file: Path, name: str, dtype) -> np.ndarray:
        """A tensor whose dtype safetensors' numpy reader cannot name (bf16, fp8), mapped
        straight from the file's bytes."""
        info, data_start = self._header(file)[name], self._headers[file][1]
        start, end = info["data_offsets"]
        raw = np.memmap(file, dtype=np.uint8, mode="r", offset=data_start + start, shape=(end - start,))
        return raw.view(dtype).reshape(info["shape"])


# safetensors dtypes that numpy has no name for: ml_dtypes has them.
_NON_NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _safetensors_names(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return list(f.keys())
    except Exception as e:
        # Say what the usual cause is: safetensors' own words ("incomplete metadata, file not
        # fully covered") do not tell a user that the download or copy was cut short.
        raise JfireError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt") from None


class GGUFSource:
    """A GGUF file, dequantized to float32 with the `gguf` package."""

    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:
            raise JfireError(f"{self.path} is not a readable GGUF file ({e})") from None
        self.metadata = gguf_metadata(self.reader)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = config_from_gguf(self.metadata, has_output_tensor="output.weight" in self._tensors)
        # llama.cpp's converter interleaves the rotary halves of Q and K for the 'llama' arch.
        self._permuted = self.metadata["general.architecture"] == "llama"

    def get(self, name: str, spec: ParamSpec) -> np.ndarray:
        import gguf

        gguf_name = _gguf_name(name, spec)
        tensor = self._tensors.get(gguf_name)
        if tensor is None:
            raise JfireError(f"{self.path.name}: tensor '{gguf_name}' is missing (expected shape {spec.source_shape})")
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in tensor.shape])))
        if self._permuted and spec.gguf_rotary_heads:
            data = _unpermute_rotary(data, spec.gguf_rotary_heads)
        return data

    def names(self) -> list[str]:
        return list(self._tensors)


def _gguf_name(hf_name: str, spec: ParamSpec) -> str:
    if not spec.per_layer:
        return spec.gguf
    layer = hf_name.split(".")[2]  # model.layers.{i}.…
    return spec.gguf.format(i=layer)


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    # Inverse of llama.cpp's permute: per head, rows (pairs, 2) -> (2, pairs).
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(reader) -> dict:
    """GGUF key-value metadata as plain Python values (strings decoded, arrays as lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a value type this gguf version cannot decode: not one we read
            continue
    return meta

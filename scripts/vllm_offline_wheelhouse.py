#!/usr/bin/env python3
"""A wheelhouse of vLLM for a machine without network, in parts small enough to carry one by one.

``build`` (on a machine with PyPI) resolves vLLM's requirements for the target's Python and
platform, minus what the target already has (``--installed``: a ``pip freeze`` of it, or a list
of names; default ``scripts/gpu_image_packages.txt``, the H100 image's package set) and minus
large optional kernel packages vLLM imports only when a feature asks for them (``EXCLUDED``),
downloads each wheel with ``pip download --no-deps``, writes ``manifest.json`` and cuts one tar of
the wheels into parts of at most ``--part-mib`` MiB with their SHA-256 sums. Versions: the newest
release that satisfies every specifier met on the way and has a wheel for the target (a
specifier on a package the target has is not checked: the target keeps its own version).

``stage`` (on the target) copies one part into a staging folder outside the checkout; ``install``
checks every part's sum, joins and unpacks them, ``pip install --no-index --no-deps`` every
wheel, then imports vLLM's engine to prove it loads. Only the standard library is used there.

The procedure used for the H100 lease (one run carries at most 64 MiB, and the machine stays
warm, keeping its files, for about 30 s after a run):

    python3 scripts/vllm_offline_wheelhouse.py build --vllm 0.25.1 --python-version 3.12 --out .whl
    # run 1..n-1, back to back, each carrying one part (.whl is git-ignored):
    python3 scripts/vllm_offline_wheelhouse.py stage --part .whl/parts/wheelhouse.tar.part-00
    # run n, carrying the last part and SHA256SUMS, then straight on with the tests:
    python3 scripts/vllm_offline_wheelhouse.py stage --part .whl/parts/wheelhouse.tar.part-04 \\
        --sums .whl/parts/SHA256SUMS && python3 scripts/vllm_offline_wheelhouse.py install
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_INSTALLED = HERE / "gpu_image_packages.txt"
DEFAULT_STAGE = Path("/root/kvtier-wheelhouse")
PART_NAME = "wheelhouse.tar.part-"
SUMS_NAME = "SHA256SUMS"
PYPI_JSON = "https://pypi.org/pypi/{name}/json"

EXCLUDED: dict[str, str] = {
    # Optional kernels and media: vLLM imports them only when a feature or backend asks.
    "flashinfer-python": "FlashInfer backend/sampler (set VLLM_USE_FLASHINFER_SAMPLER=0)",
    "flashinfer-cubin": "FlashInfer's prebuilt kernels",
    "flashinfer-jit-cache": "FlashInfer's prebuilt kernels",
    "tilelang": "TileLang kernels (sparse attention models)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell paths)",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL kernels",
    "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL kernels",
    "quack-kernels": "CuTe DSL kernels",
    "tokenspeed-mla": "MLA decode kernels (DeepSeek-style models)",
    "humming-kernels": "quantised MoE kernels",
    "pynvvideocodec": "video inputs",
    "torchcodec": "audio/video inputs",
    "fastsafetensors": "an optional weight loader",
    "nvidia-cudnn-frontend": "cuDNN attention paths",
    "opencv-python-headless": "image inputs (and the target has it)",
    # The target's own builds: never replaced.
    "torch": "the target's build",
    "torchvision": "the target's build",
    "torchaudio": "the target's build",
    "triton": "the target's build",
    "numpy": "the target's build",
}

PLATFORMS = [
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)),
]


def normalize(name: str) -> str:
    """PEP 503: lower case, runs of ``-_.`` -> ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_installed(path: Path) -> set[str]:
    """Names from a ``pip freeze`` / ``pip list --format=freeze`` output or a list of names."""
    names: set[str] = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[=<>!~ @;\[]", line, maxsplit=1)[0]
        if name:
            names.add(normalize(name))
    return names


# -- resolution ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Pick:
    name: str
    version: str
    file: str
    url: str
    bytes: int
    sha256: str
    why: list[str] = field(default_factory=list)


def _wheel_fits(filename: str, python: str) -> bool:
    """A wheel for CPython ``python`` (``3.12``) on manylinux x86_64, or a pure one (the tags
    pip accepts there: ``cp312``, ``abi3`` builds for ``cp3N`` N <= 12, ``py3``, ``py3N``)."""
    if not filename.endswith(".whl"):
        return False
    py, abi, plat = filename[:-4].split("-")[-3:]
    minor = int(python.split(".")[1])

    def tag_ok(tag: str) -> bool:
        if tag == "py3":
            return True
        if tag.startswith("py3") and tag[3:].isdigit():
            return int(tag[3:]) <= minor
        if tag.startswith("cp3") and tag[3:].isdigit():
            n = int(tag[3:])
            return n == minor or ("abi3" in abi.split(".") and n <= minor)
        return False

    plat_ok = plat == "any" or any(p in plat.split(".") for p in PLATFORMS)
    return plat_ok and any(tag_ok(t) for t in py.split("."))


@functools.cache
def _requires_dist(wheel_url: str) -> list[str]:
    """A wheel's ``Requires-Dist`` lines, from its PEP 658 metadata file (the wheel itself where
    the index serves none)."""
    try:
        with urllib.request.urlopen(wheel_url + ".metadata", timeout=60) as reply:
            text = reply.read().decode()
    except OSError:
        import io
        import zipfile

        with urllib.request.urlopen(wheel_url, timeout=300) as reply:
            archive = zipfile.ZipFile(io.BytesIO(reply.read()))
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


@functools.cache
def _pypi(name: str) -> dict[str, object]:
    with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=60) as reply:
        data: dict[str, object] = json.load(reply)
    return data


class _Conflict(Exception):
    def __init__(self, parent: str, message: str) -> None:
        super().__init__(message)
        self.parent = parent


def resolve(
    roots: Iterable[str], python: str, installed: set[str], excluded: set[str]
) -> tuple[list[Pick], dict[str, str]]:
    """Newest versions first; where a package's requirement contradicts an earlier pick (vLLM
    pins ``apache-tvm-ffi``, the newest ``xgrammar`` wants a later one), that package's version
    is ruled out and the resolution starts again."""
    constraints: list[str] = []
    for _ in range(50):
        try:
            return _resolve_once(roots, constraints, python, installed, excluded)
        except _Conflict as conflict:
            name, _, version = conflict.parent.partition("==")
            if not version:
                raise SystemExit(str(conflict)) from None
            print(f"{conflict}: trying {name} != {version}", file=sys.stderr)
            constraints.append(f"{name}!={version}")
    raise SystemExit("no consistent set of versions after 50 tries")


def _resolve_once(
    roots: Iterable[str],
    constraints: Iterable[str],
    python: str,
    installed: set[str],
    excluded: set[str],
) -> tuple[list[Pick], dict[str, str]]:
    """Breadth-first over requirements; returns the picks and the names left out (and why)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(
        python_version=python,
        python_full_version=f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        os_name="posix",
    )

    def python_ok(requires: object) -> bool:
        try:
            return not requires or Version(f"{python}.0") in SpecifierSet(str(requires))
        except ValueError:
            return True

    specs: dict[str, SpecifierSet] = {}
    for text in constraints:
        ruled_out = Requirement(text)
        name = normalize(ruled_out.name)
        specs[name] = specs.get(name, SpecifierSet()) & ruled_out.specifier
    picks: dict[str, Pick] = {}
    skipped: dict[str, str] = {}
    queue: list[tuple[str, str]] = [(r, "requested") for r in roots]
    while queue:
        text, parent = queue.pop(0)
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = normalize(req.name)
        if name in installed:
            skipped.setdefault(name, "on the target")
            continue
        if name in excluded:
            skipped.setdefault(name, EXCLUDED.get(name, "excluded"))
            continue
        merged = specs.get(name, SpecifierSet()) & req.specifier
        specs[name] = merged
        known = picks.get(name)
        if known is not None:
            known.why.append(parent)
            if Version(known.version) in merged:
                continue
            raise _Conflict(parent, f"{name} {known.version} picked, but {parent} wants {req}")
        data = _pypi(name)
        releases = data["releases"]
        assert isinstance(releases, dict)
        best: tuple[Version, dict[str, object]] | None = None
        for ver_text, files in releases.items():
            try:
                ver = Version(ver_text)
            except InvalidVersion:
                continue
            if not merged.contains(ver):
                continue
            fitting = [
                f
                for f in files
                if _wheel_fits(str(f["filename"]), python)
                and not f.get("yanked")
                and python_ok(f.get("requires_python"))
            ]
            if fitting and (best is None or ver > best[0]):
                best = (ver, fitting[0])
        if best is None:
            raise SystemExit(f"no wheel of {name}{merged} for CPython {python} manylinux x86_64")
        ver, file = best
        url = urllib.parse.urljoin(PYPI_JSON.format(name=name), str(file["url"]))
        digests = file["digests"]
        assert isinstance(digests, dict)
        picks[name] = Pick(
            name,
            str(ver),
            str(file["filename"]),
            url,
            int(str(file["size"])),
            str(digests["sha256"]),
            [parent],
        )
        requires = _requires_dist(url)
        for dep in requires:
            queue.append((dep, f"{name}=={ver}"))
        if req.extras:
            for dep in requires:
                dep_req = Requirement(dep)
                for extra in req.extras:
                    if dep_req.marker is not None and dep_req.marker.evaluate(
                        {**env, "extra": extra}
                    ):
                        dep_req.marker = None
                        queue.append((str(dep_req), f"{name}[{extra}]"))
    return sorted(picks.values(), key=lambda p: p.name), skipped


# -- parts --------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def split_file(source: Path, out_dir: Path, part_bytes: int) -> list[Path]:
    """``source`` cut into ``PART_NAME``NN files of at most ``part_bytes``, plus ``SHA256SUMS``."""
    if part_bytes < 1:
        raise ValueError("part size must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(PART_NAME + "*"):
        old.unlink()
    parts: list[Path] = []
    with source.open("rb") as f:
        while chunk := f.read(part_bytes):
            part = out_dir / f"{PART_NAME}{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    (out_dir / SUMS_NAME).write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts))
    return parts


def join_parts(folder: Path, target: Path) -> None:
    """Check every part against ``SHA256SUMS`` and join them into ``target``."""
    sums_file = folder / SUMS_NAME
    if not sums_file.exists():
        raise SystemExit(f"{sums_file} missing: stage it with the last part (--sums)")
    expected: dict[str, str] = {}
    for line in sums_file.read_text().splitlines():
        if line.strip():
            digest, name = line.split(None, 1)
            expected[name.strip()] = digest
    names = sorted(expected)
    present = sorted(p.name for p in folder.glob(PART_NAME + "*"))
    if present != names:
        missing = sorted(set(names) - set(present))
        raise SystemExit(
            f"parts missing in {folder}: {', '.join(missing) or 'none'}; "
            f"unexpected: {', '.join(sorted(set(present) - set(names))) or 'none'}"
        )
    with target.open("wb") as out:
        for name in names:
            part = folder / name
            if sha256(part) != expected[name]:
                raise SystemExit(f"{part}: SHA-256 mismatch (a broken transfer); send it again")
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)


# -- commands -----------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    installed = read_installed(Path(args.installed))
    excluded = {normalize(n) for n in [*EXCLUDED, *args.exclude]}
    roots = [f"vllm=={args.vllm}", *args.extra]
    picks, skipped = resolve(roots, args.python_version, installed, excluded)
    out = Path(args.out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else None
    for pick in picks:
        target = wheels / pick.file
        if target.exists() and sha256(target) == pick.sha256:
            continue
        cached = cache / pick.file if cache else None
        if cached is not None and cached.exists() and sha256(cached) == pick.sha256:
            shutil.copyfile(cached, target)
            continue
        with urllib.request.urlopen(pick.url, timeout=600) as reply, target.open("wb") as f:
            shutil.copyfileobj(reply, f)
        if sha256(target) != pick.sha256:
            target.unlink()
            raise SystemExit(f"{pick.file}: SHA-256 differs from the index's")
    keep = {p.file for p in picks}
    for stale in wheels.glob("*.whl"):
        if stale.name not in keep:
            stale.unlink()
    manifest = {
        "vllm": args.vllm,
        "python": args.python_version,
        "wheels": [asdict(p) for p in picks],
        "left_out": skipped,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "wheelhouse.tar"
        with tarfile.open(tar_path, "w") as tar:
            for pick in picks:
                tar.add(wheels / pick.file, arcname=pick.file)
        parts = split_file(tar_path, out / "parts", int(args.part_mib * (1 << 20)))
    total = sum(p.bytes for p in picks)
    print(f"{'wheel':<44} {'version':<14} {'MiB':>8}")
    for pick in picks:
        print(f"{pick.name:<44} {pick.version:<14} {pick.bytes / (1 << 20):8.2f}")
    print(
        f"{len(picks)} wheels, {total / (1 << 20):.1f} MiB, {len(parts)} parts of <= "
        f"{args.part_mib} MiB in {out / 'parts'} ({time.monotonic() - started:.0f} s)"
    )
    print(
        f"left out: {len([n for n, why in skipped.items() if why != 'on the target'])} "
        f"excluded, {sum(why == 'on the target' for why in skipped.values())} on the target"
    )
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    stage = Path(args.stage)
    stage.mkdir(parents=True, exist_ok=True)
    for item in [args.part, *([args.sums] if args.sums else [])]:
        shutil.copyfile(item, stage / Path(item).name)
        print(f"staged {item} -> {stage}")
    return 0


def _wheels_in(tar_path: Path, dest: Path) -> Iterator[Path]:
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or not member.name.endswith(".whl"):
                raise SystemExit(f"unexpected entry {member.name!r} in the wheelhouse")
            tar.extract(member, dest)
            yield dest / member.name


def cmd_install(args: argparse.Namespace) -> int:
    stage = Path(args.stage)
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "wheelhouse.tar"
        join_parts(stage, tar_path)
        wheels = list(_wheels_in(tar_path, Path(tmp)))
        subprocess.run(
            [
                args.python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                *map(str, wheels),
            ],
            check=True,
        )
    probe = "import vllm, vllm.v1.engine.llm_engine; print('vllm', vllm.__version__)"
    done = subprocess.run([args.python, "-c", probe], check=False)
    if done.returncode != 0:
        raise SystemExit("vLLM was installed but does not import (see above): a wheel is missing")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="resolve, download and cut into parts (needs PyPI)")
    build.add_argument("--vllm", default="0.25.1")
    build.add_argument("--python-version", default="3.12")
    build.add_argument("--out", default=".whl")
    build.add_argument("--installed", default=str(DEFAULT_INSTALLED))
    build.add_argument("--part-mib", type=float, default=60.0)
    build.add_argument("--exclude", action="append", default=[], metavar="NAME")
    build.add_argument("--extra", action="append", default=[], metavar="REQUIREMENT")
    build.add_argument("--cache", help="a folder of wheels already downloaded (used first)")
    build.set_defaults(func=cmd_build)
    stage = sub.add_parser("stage", help="copy one part to the staging folder (on the target)")
    stage.add_argument("--part", required=True)
    stage.add_argument("--sums", help="the parts' SHA256SUMS (with the last part)")
    stage.add_argument("--stage", default=str(DEFAULT_STAGE))
    stage.set_defaults(func=cmd_stage)
    install = sub.add_parser("install", help="check, join, pip install (on the target)")
    install.add_argument("--stage", default=str(DEFAULT_STAGE))
    install.add_argument("--python", default=sys.executable)
    install.set_defaults(func=cmd_install)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

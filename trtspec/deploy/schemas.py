"""Validate manifests against the Kubernetes OpenAPI schemas of one stated version.

The schemas come with the `kubernetes-validate` package (JSON schemas generated from each
Kubernetes release's OpenAPI document, shipped inside the wheel: no network). We use its
strict variant, where an unknown field is an error, so a misspelt key cannot slip through.
Kinds that are not Kubernetes API resources (a prometheus-operator ServiceMonitor, a
kustomization.yaml) have no schema there; callers say which kinds they expect that of.
"""

from __future__ import annotations

from collections.abc import Iterable

from trtspec.errors import TrtspecError

INSTALL_HINT = "install it with `pip install 'trtspec[deploy]'` (make install does)"


def _library():
    try:
        from kubernetes_validate import utils
    except ImportError as e:
        raise TrtspecError(f"the Kubernetes schema validator is missing; {INSTALL_HINT}") from e
    return utils


def supported_versions() -> list[str]:
    """Kubernetes minor versions whose schemas are installed, oldest first ("1.25", ...)."""
    utils = _library()
    minors = {utils.major_minor(v) for v in utils.all_versions()}
    return sorted(minors, key=lambda v: tuple(int(x) for x in v.split(".")))


def check_version(version: str) -> str:
    """``version`` as major.minor when its schemas are installed; TrtspecError otherwise."""
    v = version.removeprefix("v")
    parts = v.split(".")
    minor = ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:3]) else None
    known = supported_versions()
    if minor not in known:
        raise TrtspecError(
            f"unknown Kubernetes version '{version}': schemas are installed for "
            f"{known[0]} ... {known[-1]}; pass one of them with --kube-version"
        )
    return minor


class ManifestInvalid(TrtspecError):
    """A generated manifest does not match the Kubernetes schema: a bug in trtspec (exit 3)."""

    exit_code = 3


def validate(manifest: dict, version: str) -> None:
    """Raise ManifestInvalid naming the field when ``manifest`` breaks the schema."""
    utils = _library()
    try:
        utils.validate(manifest, check_version(version), strict=True)
    except utils.SchemaNotFoundError as e:
        raise ManifestInvalid(f"no schema for {manifest.get('kind')} {manifest.get('apiVersion')}: {e.message}") from e
    except utils.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(top level)"
        name = manifest.get("metadata", {}).get("name")
        raise ManifestInvalid(f"{manifest['kind']}/{name} is not valid Kubernetes {e.version}: {where}: {e.message}") from e


def validate_all(manifests: Iterable[dict], version: str, no_schema: Iterable[str] = ()) -> list[str]:
    """Validate each manifest; kinds in ``no_schema`` are skipped and returned by name."""
    skipped = []
    for m in manifests:
        if m["kind"] in no_schema:
            skipped.append(m["kind"])
            continue
        validate(m, version)
    return skipped

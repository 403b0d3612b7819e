"""The OpenAI front's API keys: which tenant each key is (`trtspec openai --api-keys FILE` /
`--api-key KEY`; openai/app.py's RequireKey asks every /v1 request for one).

A key file is a YAML (or JSON) mapping ``key: tenant``. A tenant is the suffix cache scope of
its keys' requests (docs/suffix.md): 1..64 bytes of printable text without "/" (a client's
``user`` narrows the scope to tenant/user inside it). The file is read again when it changes
(its mtime or size), so keys are added or revoked without a restart; a file that no longer
reads keeps the last good keys and says so in one log line. Keys are compared in constant
time (hmac.compare_digest, every key each time) and never written to a log or an error.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.errors import SpecError

DEFAULT_TENANT = "default"  # the tenant of --api-key, and of every request without keys
MAX_TENANT_BYTES = 64
log = logging.getLogger("trtspec.openai")


def parse_keys(text: str, source: str) -> dict[str, str]:
    """A key file's text as {key: tenant}; SpecError names the entry (by position, never by
    its key) and the fix."""
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{source} is not YAML or JSON ({type(err).__name__}); write one `key: tenant` per line") from None
    if not isinstance(raw, dict) or not raw:
        raise SpecError(f"{source} must be a mapping of API key to tenant (`key: tenant` per line), with at least one key")
    keys = {}
    for n, (key, tenant) in enumerate(raw.items(), 1):
        if not isinstance(key, str) or not key.strip() or any(ord(c) < 33 or ord(c) == 127 for c in key):
            raise SpecError(f"{source}: key {n} must be printable text without spaces; quote it as a string")
        keys[key] = check_tenant(tenant, f"{source}: the tenant of key {n}")
    return keys


def check_tenant(tenant, what: str) -> str:
    """A tenant name: 1..MAX_TENANT_BYTES bytes of printable text without "/" (which joins
    tenant and user in a scope, so no tenant's scopes can be another's)."""
    if not isinstance(tenant, str) or not tenant:
        raise SpecError(f"{what} must be a non-empty name")
    if len(tenant.encode("utf-8", "replace")) > MAX_TENANT_BYTES:
        raise SpecError(f"{what} is longer than {MAX_TENANT_BYTES} bytes; use a shorter name")
    if "/" in tenant or any(ord(c) < 32 or ord(c) == 127 for c in tenant):
        raise SpecError(f"{what} holds '/' or a control character; use a plain name")
    return tenant


@dataclass
class ApiKeys:
    """Keys -> tenants, from a file (re-read when it changes) or one key (tenant "default")."""

    keys: dict[str, str]
    path: Path | None = None
    _seen: tuple[int, int] | None = field(default=None, repr=False)  # (mtime_ns, size) last read

    @classmethod
    def single(cls, key: str) -> ApiKeys:
        if not key or any(ord(c) < 33 or ord(c) == 127 for c in key):
            raise SpecError("--api-key must be printable text without spaces")
        return cls({key: DEFAULT_TENANT})

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        """Read ``path`` now; SpecError (exit 2) where it cannot be read or parsed."""
        path = Path(path)
        try:
            stat = path.stat()
            keys = parse_keys(path.read_text(encoding="utf-8"), str(path))
        except OSError as err:
            raise SpecError(f"cannot read the API key file {path} ({err.strerror}); give a readable file") from None
        except UnicodeDecodeError:
            raise SpecError(f"{path} is not UTF-8 text; write it as a YAML or JSON mapping of key to tenant") from None
        return cls(keys, path, (stat.st_mtime_ns, stat.st_size))

    @property
    def tenants(self) -> set[str]:
        return set(self.keys.values())

    def tenant_of(self, given: str | None) -> str | None:
        """The tenant of key ``given`` (None: no such key). Every key is compared, each in
        constant time, so the time taken says nothing about which key came close."""
        self.refresh()
        found = None
        probe = (given or "").encode()
        for key, tenant in self.keys.items():
            if hmac.compare_digest(probe, key.encode()) and given:
                found = tenant
        return found

    def refresh(self) -> None:
        """Re-read the file if it changed; a file that does not read keeps the last good keys
        (one log line per change, naming the file and the problem, never a key)."""
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except OSError as err:
            seen = (-1, -1)
            problem = f"cannot read it ({err.strerror})"
        else:
            seen = (stat.st_mtime_ns, stat.st_size)
            problem = None
        if seen == self._seen:
            return
        self._seen = seen
        if problem is None:
            try:
                self.keys = parse_keys(self.path.read_text(encoding="utf-8"), str(self.path))
                log.warning(f"API keys re-read from {self.path}: {len(self.keys)} keys, {len(self.tenants)} tenants")
                return
            except (OSError, UnicodeDecodeError, SpecError) as err:
                problem = str(err) if isinstance(err, SpecError) else f"cannot read it ({type(err).__name__})"
        log.error(f"API key file {self.path} changed but {problem}; keeping the last good keys")

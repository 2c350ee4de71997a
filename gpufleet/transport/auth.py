"""SSH authentication for gpufleet: public keys only, never a prompt (OpenSSH BatchMode).

Internal to gpufleet.transport (import from there). Keys are tried in this order: the
inventory identity_file, ssh_config IdentityFile, ssh-agent, then ~/.ssh/id_* (only when no
IdentityFile is configured, as OpenSSH does); passphrase-protected keys not in the agent are
skipped; never a password or keyboard-interactive prompt.
"""
from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Optional

import paramiko
from paramiko.auth_strategy import AuthStrategy, InMemoryPrivateKey, OnDiskPrivateKey

from gpufleet.errors import AuthFailed


def _pub_blob(path: str) -> Optional[bytes]:
    try:
        with open(path + ".pub", "r", encoding="ascii", errors="replace") as fh:
            return base64.b64decode(fh.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class BatchAuth(AuthStrategy):
    """Public-key auth only, never a prompt (OpenSSH BatchMode): see the module docstring."""

    def __init__(self, ssh_config, fabric_config, username):
        super().__init__(ssh_config=ssh_config)
        self.username = username
        self.config = fabric_config
        self.notes: list[str] = []
        self.tried: list[str] = []
        try:
            self.agent: Optional[paramiko.Agent] = paramiko.Agent()
        except Exception:
            self.agent = None

    def _load(self, path: str, where: str):
        try:
            key = paramiko.PKey.from_path(path)
        except FileNotFoundError:
            if where != "implicit-home":
                self.notes.append(f"{path} not found")
            return None
        except paramiko.PasswordRequiredException:
            self.notes.append(f"{path} is passphrase-protected (load it into ssh-agent)")
            return None
        except TypeError as exc:  # cryptography: "Password was not given but ... encrypted"
            text = str(exc).lower()
            if "password" in text or "encrypted" in text:
                self.notes.append(f"{path} is passphrase-protected (load it into ssh-agent)")
            else:
                self.notes.append(f"{path} unreadable (TypeError)")
            return None
        except Exception as exc:
            self.notes.append(f"{path} unreadable ({type(exc).__name__})")
            return None
        return OnDiskPrivateKey(username=self.username, source=where, path=Path(path), pkey=key)

    def get_sources(self):
        seen: set[bytes] = set()
        explicit = list(self.config.authentication.identities or [])
        configured = list(self.ssh_config.get("identityfile", []) or [])
        # paramiko only knows these source labels: inventory keys are "python-config"
        files = [(p, "python-config") for p in explicit] + [(p, "ssh-config") for p in configured]
        agent_keys = []
        if self.agent is not None:
            try:
                agent_keys = list(self.agent.get_keys())
            except Exception:
                agent_keys = []
        agent_blobs = {k.asbytes() for k in agent_keys}
        if str(self.ssh_config.get("identitiesonly", "no")).lower() == "yes":
            # only agent keys whose public half is a configured identity (IdentityFile.pub)
            wanted = {_pub_blob(os.path.expanduser(p)) for p, _w in files} - {None}
            agent_keys = [k for k in agent_keys if k.asbytes() in wanted]
        for path, where in files:
            src = self._load(os.path.expanduser(path), where)
            if src is not None and src.pkey.asbytes() not in seen:
                seen.add(src.pkey.asbytes())
                self.tried.append(path)
                yield src
        for key in agent_keys:
            if key.asbytes() not in seen:
                seen.add(key.asbytes())
                self.tried.append("agent key")
                yield InMemoryPrivateKey(username=self.username, pkey=key)
        if not configured:
            for name in ("id_rsa", "id_ecdsa", "id_ed25519"):
                path = os.path.expanduser(f"~/.ssh/{name}")
                src = self._load(path, "implicit-home")
                if src is not None and src.pkey.asbytes() not in seen | agent_blobs:
                    seen.add(src.pkey.asbytes())
                    self.tried.append(f"~/.ssh/{name}")
                    yield src

    def authenticate(self, transport):
        try:
            return super().authenticate(transport)
        except paramiko.AuthenticationException as exc:
            if self.tried:
                names = sorted(set(self.tried), key=self.tried.index)
                parts = ["tried " + ", ".join(names)] + self.notes
            elif self.notes:
                parts = ["no usable key"] + self.notes
            else:
                parts = ["no key to try: no identity_file, ssh-agent key or ~/.ssh/id_*"]
            if "partial" in repr(getattr(exc, "result", "")).lower():
                parts.append("the server wants a second factor; gpufleet never prompts")
            raise AuthFailed("; ".join(parts)) from None
        finally:
            if self.agent is not None:
                try:
                    self.agent.close()
                except Exception:
                    pass

"""The handshake's messages: the coordinator's challenge, the worker's signed hello with
its device profile, and the coordinator's signed welcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from common.errors import (
    ProtocolError,
)
from common.job_about import JobAbout, text_problem
from common.limits import WireLimits
from common.message_fields import integer, number, obj, required, text
from common.signing import SIGNATURE_FIELD


@dataclass(frozen=True)
class DeviceProfile:
    device: str = "cpu"  # "cpu" or "cuda"
    device_name: str = ""
    threads: int = 1
    ram_bytes: int = 0
    mem_cap_bytes: int = 0  # largest tile (operands + output) this worker accepts
    gflops: float = 0.0  # measured at start-up

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "threads": self.threads,
            "ram_bytes": self.ram_bytes,
            "mem_cap_bytes": self.mem_cap_bytes,
            "gflops": self.gflops,
        }

    @classmethod
    def from_json(cls, h: dict[str, Any], limits: WireLimits) -> DeviceProfile:
        m = "hello.profile"
        device = text(h, "device", m, limits)
        if device not in ("cpu", "cuda"):
            raise ProtocolError(f'{m}: device must be "cpu" or "cuda", not {device!r}')
        return cls(
            device=device,
            device_name=text(h, "device_name", m, limits),
            threads=integer(h, "threads", m, lo=1, hi=4096),
            ram_bytes=integer(h, "ram_bytes", m),
            mem_cap_bytes=integer(h, "mem_cap_bytes", m),
            gflops=number(h, "gflops", m),
        )


@dataclass(frozen=True)
class Challenge:
    """The coordinator's first message on every connection (see ``common.auth``)."""

    TYPE: ClassVar[str] = "challenge"
    nonce: str  # fresh per connection: the hello's signature covers it
    coordinator_key: str  # hex of the raw Ed25519 public key
    token_required: bool = False  # a private pool: the hello must prove the join token

    def to_header(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "coordinator_key": self.coordinator_key,
            "token_required": self.token_required,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Challenge:
        return cls(
            nonce=text(h, "nonce", "challenge", limits),
            coordinator_key=text(h, "coordinator_key", "challenge", limits),
            token_required=required(h, "token_required", bool, "challenge"),
        )


@dataclass(frozen=True)
class Hello:
    """The worker's answer to a challenge: who it is, what it has, and proof of its key."""

    TYPE: ClassVar[str] = "hello"
    name: str  # display name only: identity, credit and reputation follow worker_key
    profile: DeviceProfile
    window: int  # tiles the worker wants in flight (prefetch)
    client: str = "cleave-worker"
    worker_key: str = ""  # hex of the worker's raw Ed25519 public key
    nonce: str = ""  # the worker's own challenge: the welcome's signature covers it
    token_proof: str = ""  # HMAC of the join token (private pools), never the token
    cache_bytes: int = 0  # operand blocks it keeps between tasks; 0: send every operand
    # Sent here by another rank's welcome: this rank does not send it on again.
    directed: bool = False
    sig: str = ""  # by worker_key, over the coordinator's nonce and key and this header

    def to_header(self) -> dict[str, Any]:
        header = {
            "name": self.name,
            "profile": self.profile.to_json(),
            "window": self.window,
            "client": self.client,
            "worker_key": self.worker_key,
            "nonce": self.nonce,
            "token_proof": self.token_proof,
            "cache_bytes": self.cache_bytes,
        }
        if self.directed:
            header["directed"] = True
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Hello:
        return cls(
            name=text(h, "name", "hello", limits),
            profile=DeviceProfile.from_json(obj(h, "profile", "hello"), limits),
            window=integer(h, "window", "hello", lo=1, hi=64),
            client=text(h, "client", "hello", limits),
            worker_key=text(h, "worker_key", "hello", limits),
            nonce=text(h, "nonce", "hello", limits),
            token_proof=text(h, "token_proof", "hello", limits),
            cache_bytes=integer(h, "cache_bytes", "hello") if "cache_bytes" in h else 0,
            directed=required(h, "directed", bool, "hello") if "directed" in h else False,
            sig=text(h, SIGNATURE_FIELD, "hello", limits) if SIGNATURE_FIELD in h else "",
        )


@dataclass(frozen=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    worker_id: str  # this connection's id at the coordinator
    coordinator_key: str  # hex of the raw Ed25519 public key
    heartbeat_interval_s: float
    max_frame_bytes: int
    job: str
    # What the job is, in the operator's words: signed with the rest of the welcome.
    about: JobAbout | None = None
    # One of several coordinator ranks of the job: which one (0-based) of how many.
    rank: int = 0
    ranks: int = 0  # 0: a coordinator alone
    # Serve the rank at this ws(s):// URL instead (it speaks for the same key): the
    # front door sends a joining worker where the job needs it. "": stay here.
    serve_at: str = ""
    sig: str = ""  # by coordinator_key, over the hello's nonce and worker key

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {
            "worker_id": self.worker_id,
            "coordinator_key": self.coordinator_key,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "max_frame_bytes": self.max_frame_bytes,
            "job": self.job,
        }
        if self.about is not None:
            header["about"] = self.about.to_header()
        if self.ranks:
            header["rank"], header["ranks"] = self.rank, self.ranks
        if self.serve_at:
            header["serve_at"] = self.serve_at
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Welcome:
        ranks = integer(h, "ranks", "welcome", hi=1 << 16) if "ranks" in h else 0
        rank = integer(h, "rank", "welcome", hi=max(0, ranks - 1)) if ranks else 0
        serve_at = _serve_at(h, limits) if "serve_at" in h else ""
        return cls(
            worker_id=text(h, "worker_id", "welcome", limits),
            coordinator_key=text(h, "coordinator_key", "welcome", limits),
            heartbeat_interval_s=number(h, "heartbeat_interval_s", "welcome", lo=0.01, hi=3600),
            max_frame_bytes=integer(h, "max_frame_bytes", "welcome", lo=1),
            job=text(h, "job", "welcome", limits),
            about=_about(h) if "about" in h else None,
            rank=rank,
            ranks=ranks,
            serve_at=serve_at,
            sig=text(h, SIGNATURE_FIELD, "welcome", limits) if SIGNATURE_FIELD in h else "",
        )


MAX_URL_CHARS = 512


def _serve_at(h: dict[str, Any], limits: WireLimits) -> str:
    url = text(h, "serve_at", "welcome", limits, max_chars=MAX_URL_CHARS)
    if not url.startswith(("ws://", "wss://")) or any(c.isspace() for c in url):
        raise ProtocolError('welcome: field "serve_at" must be a ws:// or wss:// URL')
    problem = text_problem(url, max_chars=MAX_URL_CHARS)
    if problem:
        raise ProtocolError(f'welcome: field "serve_at" {problem}')
    return url


def _about(h: dict[str, Any]) -> JobAbout:
    try:
        return JobAbout.from_header(h["about"])
    except ValueError as exc:
        raise ProtocolError(f"welcome: {exc}") from None

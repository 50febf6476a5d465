"""The gateway's typed config."""

from dataclasses import dataclass


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the `model` name clients use; defaults to the checkpoint dir name
    max_request_bytes: int = 4 * 2**20
    database_url: str = "sqlite:///./moegate.db"
    auth_cache_ttl_s: float = 5.0  # how long a revoked key may keep working

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")

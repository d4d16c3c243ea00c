"""Where a block's bytes live."""
import enum


class Tier(str, enum.Enum):
    HOST = "host"
    NVME = "nvme"
    REMOTE = "remote"  # a store several servers share (Redis)

"""Where a block's bytes live."""
import enum


class Tier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"

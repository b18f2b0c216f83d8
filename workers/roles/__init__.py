"""One worker class per role; each accepts only its own stage message (see protocol ROLE_ACCEPTS)."""

from mserve.workers.roles.decode import DecodeWorker
from mserve.workers.roles.encode import EncodeWorker
from mserve.workers.roles.prefill import PrefillWorker
from mserve.workers.roles.unified import UnifiedWorker

ROLE_CLASSES = {cls.ROLE: cls for cls in (EncodeWorker, PrefillWorker, DecodeWorker, UnifiedWorker)}

__all__ = ["ROLE_CLASSES", "EncodeWorker", "PrefillWorker", "DecodeWorker", "UnifiedWorker"]

"""What a shared server keeps about who used it: the audit log (:mod:`.audit`: who did what,
from which key, when) and usage metering (:mod:`.usage`: tokens trained and sampled, compute
seconds, checkpoint bytes), for the Tinker API and the RL job API alike, in the server's
SQLite file so that both survive a restart."""

from opentinker.server.accounting.audit import AuditEntry, AuditLog
from opentinker.server.accounting.usage import UsageBucket, UsageMeter

__all__ = ["AuditEntry", "AuditLog", "UsageBucket", "UsageMeter"]

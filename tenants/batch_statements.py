"""The batch runner's hot-path SQL, built once per store on the Core tables, every value a parameter.

A batch line costs the gateway a share of a claim, a result write, a usage row
and the runner's "anything to finalize?" check. Built per call (ORM ``select``/
``update`` with fresh criteria, ORM bulk inserts, run through an ORM session),
these were most of the gateway's CPU per line: statement construction,
cache-key generation, and the ORM's synchronize-session evaluation of every
UPDATE. Built once, a call only binds parameters (the compiled form is cached
by the engine), and they run on a plain synchronous connection, a whole
transaction per call on one worker thread (``tenants.sync_transactions``).
"""

from sqlalchemy import String, and_, bindparam, insert, or_, select, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from tenants.models import Adapter, Batch, BatchLine, Quota, Usage


class by_rowid(FunctionElement):
    """A line's ``status``, compared without its index: ``+status`` on SQLite, plain elsewhere.

    Statements that name their lines by id must find them by primary key. Without statistics
    SQLite's planner expects an equality on ``ix_batch_lines_claim``'s first column to match a
    handful of rows and prefers it to a list of ids, so ``id IN (...) AND status = 'running'``
    walked every running (or, with the claim's OR, every pending) line of the table: a claim cost
    grew with the batch, 1.9 ms per 64 lines at 400 lines, 9.2 ms at 20,000. SQLite documents the
    unary ``+`` as the way to keep a term from using an index; PostgreSQL's planner has
    statistics and needs no hint.
    """

    type = String()
    name = "by_rowid"
    inherit_cache = True


@compiles(by_rowid)
def _by_rowid_default(element, compiler, **kw):
    (column,) = element.clauses
    return compiler.process(column, **kw)


@compiles(by_rowid, "sqlite")
def _by_rowid_sqlite(element, compiler, **kw):
    (column,) = element.clauses
    return "+" + compiler.process(column, **kw)


class BatchStatements:
    """Statements of ``BatchStore.claim``, ``renew``, ``release_all``, ``finish_many`` and ``ready_to_finalize``.

    Parameters are named in each attribute's comment.
    """

    __slots__ = ("open_batches", "pick_pending", "pick_lapsed", "lease", "claimed", "renew", "release",
                 "release_finalizing", "take", "write", "count_done", "count_failed", "discounts", "usage",
                 "finalizable")

    def __init__(self, postgresql: bool, model: str | None = None) -> None:
        """``model``: only batches for this model are claimed and finalized (gateways serving other
        models may share the database); None takes every batch."""
        lines, batches, quotas = BatchLine.__table__, Batch.__table__, Quota.__table__
        # The adapters in the database are served over this gateway's base model: their batches are its too.
        served = (or_(batches.c.model == model, batches.c.model.in_(select(Adapter.__table__.c.name)))
                  if model is not None else True)
        ids = bindparam("ids", expanding=True)
        status = by_rowid(lines.c.status)  # in statements that name their lines by id
        # A claim reads the open batches oldest first, then each one's pending lines in line order
        # straight off ix_batch_lines_claim (status, batch_id, line_no), stopping at the limit: its cost
        # is the lines it takes, not the lines still waiting (one ORDER BY over the join sorted them all).
        # -> ids of the batches lines are claimed from, oldest first
        self.open_batches = (select(batches.c.id).where(batches.c.status == "in_progress", served)
                             .order_by(batches.c.created_at, batches.c.id))
        # bid, limit -> a batch's first pending line ids
        self.pick_pending = (select(lines.c.id).where(lines.c.status == "pending", lines.c.batch_id == bindparam("bid"))
                             .order_by(lines.c.line_no).limit(bindparam("limit")))
        # now, limit -> ids of running lines whose lease lapsed (their gateway died), in open batches
        self.pick_lapsed = (select(lines.c.id).join(batches, batches.c.id == lines.c.batch_id)
                            .where(lines.c.status == "running", lines.c.lease_expires < bindparam("now"),
                                   batches.c.status == "in_progress", served)
                            .order_by(lines.c.id).limit(bindparam("limit")))
        if postgresql:  # replicas claim different lines instead of queueing on the same rows
            self.pick_pending = self.pick_pending.with_for_update(skip_locked=True)
            self.pick_lapsed = self.pick_lapsed.with_for_update(of=lines, skip_locked=True)
        # ids, now, owner, until: the WHERE repeats the runnable test (on SQLite the write lock makes it
        # moot, elsewhere it is the guard)
        runnable = or_(status == "pending", and_(status == "running", lines.c.lease_expires < bindparam("now")))
        self.lease = (update(lines).where(lines.c.id.in_(ids), runnable)
                      .values(status="running", lease_owner=bindparam("owner"), lease_expires=bindparam("until"),
                              attempts=lines.c.attempts + 1))
        held = and_(lines.c.lease_owner == bindparam("owner"), status == "running")
        # ids, owner -> what ClaimedLine holds, by line id
        self.claimed = (select(lines.c.id, lines.c.batch_id, batches.c.tenant_id, batches.c.endpoint,
                               lines.c.custom_id, lines.c.body_json, lines.c.attempts)
                        .join(batches, batches.c.id == lines.c.batch_id).where(lines.c.id.in_(ids), held)
                        .order_by(lines.c.id))
        # ids, owner, until
        self.renew = update(lines).where(lines.c.id.in_(ids), held).values(lease_expires=bindparam("until"))
        # owner, until: every line the owner holds (found through the index: running lines only), and
        # every batch it is finalizing
        self.release = (update(lines).where(lines.c.lease_owner == bindparam("owner"), lines.c.status == "running")
                        .values(lease_expires=bindparam("until")))
        self.release_finalizing = (update(batches).where(batches.c.lease_owner == bindparam("owner"),
                                                         batches.c.status == "finalizing")
                                   .values(lease_expires=bindparam("until")))
        # ids, owner -> the ids still held, now locked for the transaction (row locks on PostgreSQL,
        # BEGIN IMMEDIATE's write lock on SQLite)
        self.take = update(lines).where(lines.c.id.in_(ids), held).values(lease_expires=None).returning(lines.c.id)
        # executemany of lid, owner, new_status, result
        self.write = (update(lines).where(lines.c.id == bindparam("lid"), held)
                      .values(status=bindparam("new_status"), result_json=bindparam("result")))
        # bid, n
        self.count_done, self.count_failed = (
            update(batches).where(batches.c.id == bindparam("bid")).values({column: column + bindparam("n")})
            for column in (batches.c.completed, batches.c.failed))
        # tenants -> (tenant_id, batch_discount)
        self.discounts = (select(quotas.c.tenant_id, quotas.c.batch_discount)
                          .where(quotas.c.tenant_id.in_(bindparam("tenants", expanding=True))))
        # executemany of usage rows (TenantStore.usage_values)
        self.usage = insert(Usage.__table__)
        # now -> ids of batches with no line pending or running, not finalized by anyone alive
        open_lines = (select(lines.c.id).where(lines.c.batch_id == batches.c.id,
                                               lines.c.status.in_(("pending", "running"))).exists())
        self.finalizable = select(batches.c.id).where(
            or_(batches.c.status.in_(("in_progress", "cancelling")),
                and_(batches.c.status == "finalizing", batches.c.lease_expires < bindparam("now"))),
            ~open_lines, served)

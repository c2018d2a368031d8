"""pytest-xdist's loadscope scheduling, made to finish after a worker crashes.

A worker that dies (a segfault, or pytest-timeout ending a stuck test) is replaced, and
xdist 3.8's LoadScopeScheduling then deadlocks the run (pytest-dev/pytest-xdist#1323, #1327,
#1378): it puts every module the dead worker ever ran back on the queue, finished ones
included, and hands them out as empty units that never report back; and it reruns the test
that crashed, which crashes the replacement too. A CI run sat idle until its time limit.

Here a dead worker's modules go back on the queue with only their unfinished tests, and a
worker that takes the last unit is told that no more work follows, so that it runs its last
test (a worker holds back a test until it knows the one after it, or that none comes).

The test a worker died in runs once more, on a new worker (`retry_crash`): in full runs a
worker has died of a segfault inside XLA:CPU's executable serialization (jfire/compile_cache.py),
an intermittent native crash no test alone reproduces. The report says "rerun" for that first
crash; a second crash of the same test fails it. A test that fails is never rerun."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

_RETRIED: set[str] = set()  # the tests already run again after a crash


class RecoveringLoadScopeScheduling(LoadScopeScheduling):
    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]  # a worker runs its tests in order: the first not done is the one it died in
        # Back on the queue (the new worker takes them once it has collected; the others as they
        # finish tests), unless `mark_test_pending` puts the crashed test back too.
        for scope, unit in workload.items():
            left = {nodeid: done or nodeid == crashed for nodeid, done in unit.items()}
            if not all(left.values()):
                self.workqueue[scope] = left
        return crashed

    def mark_test_pending(self, item: str) -> None:
        """`item` (the test a worker died in) runs again, in its place among its module's tests
        still to run (its module's fixtures set up anew on the worker that takes it)."""
        scope = self._split_scope(item)
        self.workqueue.setdefault(scope, {})[item] = False

    def _reschedule(self, node):
        # A node still collecting, or whose collection xdist refused (it differs from the
        # others': a test file changed under a running suite), has nothing to be given work by
        # (stock xdist then fails the whole run on a KeyError).
        if node in self.registered_collections:
            super()._reschedule(node)

    def _assign_work_unit(self, node):
        super()._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


def retry_crash(crashitem: str, report, sched) -> None:
    """xdist's pytest_handlecrashitem: the first crash of a test reports "rerun" and puts the
    test back on the queue; a second crash leaves the report failed."""
    if crashitem in _RETRIED or not isinstance(sched, RecoveringLoadScopeScheduling):
        return
    _RETRIED.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}; run again on a new worker"


def rerun_status(report):
    """pytest_report_teststatus for those reports: counted as "rerun", shown as R."""
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None

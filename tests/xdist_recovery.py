"""pytest-xdist's loadscope scheduling, made to finish after a worker crashes.

A worker that dies (a segfault, or pytest-timeout ending a stuck test) is replaced, and
xdist 3.8's LoadScopeScheduling then deadlocks the run (pytest-dev/pytest-xdist#1323, #1327,
#1378): it puts every module the dead worker ever ran back on the queue, finished ones
included, and hands them out as empty units that never report back; and it reruns the test
that crashed, which crashes the replacement too. A CI run sat idle until its time limit.

Here a dead worker's modules go back on the queue with only their unfinished tests, the
crashed one counted as done (xdist has already reported it failed), and a worker that takes
the last unit is told that no more work follows, so that it runs its last test (a worker
holds back a test until it knows the one after it, or that none comes)."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling


class RecoveringLoadScopeScheduling(LoadScopeScheduling):
    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]  # a worker runs its tests in order: the first not done is the one it died in
        for scope, unit in workload.items():
            left = {nodeid: done or nodeid == crashed for nodeid, done in unit.items()}
            if not all(left.values()):
                self.workqueue[scope] = left
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _assign_work_unit(self, node):
        super()._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()

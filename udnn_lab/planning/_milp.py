"""The exact planner's mixed-integer program, built from a menu and solved by HiGHS (through highspy).

Binary variables: for each offload option, one per release op and one per prefetch op (as
many of each chosen: one of each, or none); one per recompute option. Continuous ones:
when each op that a choice can delay begins its work (``P``: after the copies it waits for;
``Q``: after its recomputations and the prefetches it reads); when each copy out (``E``)
and in (``H``) ends; the bytes away at each memory segment (``A``); the step's end (``Z``).
The rows follow the simulator's recursions (NOTE [simulated streams]): a copy out starts
when its op ends and its stream is free; a release op waits for its copy; a prefetch starts
when its op is reached and its stream is free; the first op that reads the tensor waits
for it; recomputations run before their op. Memory is the keep-all curve less what is away,
at the highest op of each segment between two changes, plus what a recomputation puts on the
device that the curve does not have: the sources the runtime holds for it, until the last
chosen recomputation reading each, and at its op the most any one of the recomputations there
makes (continuous variables at least each of several choices: ``_most``).
Sizes are in MiB and times in units of the keep-all compute time, so that the solver sees
numbers near one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from udnn_lab.planning._exact_options import Choice, Menu

MIB = float(1 << 20)
GAP = 1e-3  # solved: the plan is proven within 0.1% of the fastest of the menu
STREAM_STARTS = 24


@dataclass
class _Program:
    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, lower: float = 0.0, upper: float = np.inf, integer: bool = False, cost: float = 0.0) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def at_least(self, terms: dict[int, float], bound: float) -> None:
        self.rows.append((terms, bound, np.inf))

    def equal(self, terms: dict[int, float], value: float) -> None:
        self.rows.append((terms, value, value))

    def at_most(self, terms: dict[int, float], bound: float) -> None:
        self.rows.append((terms, -np.inf, bound))


@dataclass(frozen=True)
class Outcome:
    status: str  # 'optimal' (within GAP), 'infeasible', 'time limit', or HiGHS' own word
    choice: Choice | None  # the best choice found (also at a time limit, when there is one)
    step_s: float | None  # the program's step time for it
    bound_s: float | None  # no choice of the menu is faster than this
    binaries: int


def solve(menu: Menu, times_s: np.ndarray, curve_bytes: np.ndarray, budget: int, time_limit_s: float,
          start: Choice | None = None, upper_s: float | None = None) -> Outcome:
    """The fastest choice of ``menu`` within ``budget`` at every op (``curve_bytes``: the keep-all curve as the
    budget counts it). ``start``: a choice that fits, to begin from; ``upper_s``: its step time."""
    import highspy  # optional dependency: the [exact] extra

    unit = float(times_s.sum()) or 1.0
    built = _Builder(menu, times_s / unit, unit, curve_bytes / MIB, budget / MIB,
                     None if upper_s is None else upper_s / unit)
    program = built.program
    binaries = sum(program.integer)
    if built.infeasible:
        return Outcome("infeasible", None, None, None, binaries)
    solver = highspy.Highs()
    for option, value in (("output_flag", False), ("time_limit", float(time_limit_s)), ("mip_rel_gap", GAP),
                          ("threads", 1), ("random_seed", 0)):
        solver.setOptionValue(option, value)
    solver.passModel(_lp(highspy, program))
    if start is not None:
        values = built.encode(start)
        solver.setSolution(len(values), np.array(list(values), dtype=np.int32),
                           np.array(list(values.values()), dtype=np.float64))
    solver.run()
    status = solver.getModelStatus()
    info = solver.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return Outcome("infeasible", None, None, None, binaries)
    found = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    choice = built.read(np.asarray(solver.getSolution().col_value)) if found else None
    step = float(solver.getSolution().col_value[built.Z]) * unit if found else None
    word = {highspy.HighsModelStatus.kOptimal: "optimal", highspy.HighsModelStatus.kTimeLimit: "time limit"}
    return Outcome(word.get(status, solver.modelStatusToString(status)), choice, step,
                   float(info.mip_dual_bound) * unit, binaries)


def _lp(highspy, program: _Program):
    entries = np.array([(col, r, value) for r, (terms, _, _) in enumerate(program.rows)
                        for col, value in terms.items()], dtype=np.float64).reshape(-1, 3)
    entries = entries[np.lexsort((entries[:, 1], entries[:, 0]))]  # by column, then row
    columns = entries[:, 0].astype(np.int64)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(program.cost), len(program.rows)
    lp.col_cost_ = np.array(program.cost)
    lp.col_lower_, lp.col_upper_ = np.array(program.lower), np.array(program.upper)
    lp.row_lower_ = np.array([r[1] for r in program.rows])
    lp.row_upper_ = np.array([r[2] for r in program.rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(columns, np.arange(len(program.cost) + 1)).astype(np.int32)
    lp.a_matrix_.index_ = entries[:, 1].astype(np.int32)
    lp.a_matrix_.value_ = entries[:, 2]
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in program.integer]
    return lp


class _Builder:
    """The program's variables and rows; times in units of the keep-all compute (``unit`` seconds), sizes in MiB."""

    def __init__(self, menu: Menu, times: np.ndarray, unit: float, curve: np.ndarray, budget: float,
                 upper: float | None) -> None:
        self.menu, self.times, self.unit, self.program = menu, times, unit, _Program()
        self.starts = np.concatenate([[0.0], np.cumsum(times)])  # each op's start with nothing delaying it
        self.infeasible = False
        self.maxima: dict[int, list[tuple[int, float]]] = {}  # continuous variable -> what it is at least (_most)
        self.bound = upper if upper is not None else self._time_bound()
        self._choices()
        self._clock()
        self._copies_out()
        self._copies_in()
        self._stream_work()
        self._memory(curve, budget)

    def _time_bound(self) -> float:
        """No plan of the menu takes longer: compute, each tensor's dearest recompute, every copy."""
        dearest: dict[int, float] = {}
        for option in self.menu.recomputes:
            for t in option.action.tensors:
                dearest[t] = max(dearest.get(t, 0.0), option.time_s)
        copies = sum(o.d2h_s + o.h2d_s for o in self.menu.offloads)
        return float(self.starts[-1] + (sum(dearest.values()) + copies) / self.unit)

    def _time(self, earliest: float) -> int:
        """A time variable: never before ``earliest``, never after the bound (no faster plan is later)."""
        return self.program.var(earliest, self.bound * (1 + 1e-9) + 1e-12)

    def _choices(self) -> None:
        p = self.program
        self.release = [{r: p.var(0, 1, True) for r in o.releases} for o in self.menu.offloads]
        self.prefetch = [{q: p.var(0, 1, True) for q in o.prefetches} for o in self.menu.offloads]
        self.recompute = [p.var(0, 1, True) for _ in self.menu.recomputes]
        dropping: dict[int, dict[int, float]] = {}
        for i, offload in enumerate(self.menu.offloads):
            terms = {v: 1.0 for v in self.release[i].values()}
            p.equal({**terms, **{v: -1.0 for v in self.prefetch[i].values()}}, 0.0)  # as many of each
            dropping.setdefault(offload.candidate.tensor, {}).update(terms)
        for j, recompute in enumerate(self.menu.recomputes):
            for t in recompute.action.tensors:
                dropping.setdefault(t, {})[self.recompute[j]] = 1.0
        for terms in dropping.values():
            p.at_most(terms, 1.0)  # one action per tensor
        for j, recompute in enumerate(self.menu.recomputes):
            for source in recompute.keeps:  # what a replay reads stays on the device
                p.at_most({**dropping.get(source, {}), self.recompute[j]: 1.0}, 1.0)

    def _clock(self) -> None:
        """P[k]: op k's handling begins, after the copies its release points wait for; Q[k]: its own compute
        begins, after its recomputations and the prefetches it reads. Only ops a choice can delay get them."""
        p, starts = self.program, self.starts
        ops = {0, len(self.times) - 1} | {o.candidate.last_forward for o in self.menu.offloads}
        for o in self.menu.offloads:
            ops |= set(o.releases) | set(o.prefetches) | set(o.readers)
        ops |= {r.action.at_op for r in self.menu.recomputes}
        self.ops = sorted(ops)
        self.P = {k: self._time(starts[k]) for k in self.ops}
        self.Q = {k: self._time(starts[k]) for k in self.ops}
        replays: dict[int, dict[int, float]] = {}
        for j, option in enumerate(self.menu.recomputes):
            replays.setdefault(option.action.at_op, {})[self.recompute[j]] = -option.time_s / self.unit
        for before, k in zip([None, *self.ops[:-1]], self.ops):
            if before is not None:  # the ops between run undelayed
                p.at_least({self.P[k]: 1.0, self.Q[before]: -1.0}, starts[k] - starts[before])
            p.at_least({self.Q[k]: 1.0, self.P[k]: -1.0, **replays.get(k, {})}, 0.0)
        last = self.ops[-1]
        self.Z = p.var(starts[-1], self.bound * (1 + 1e-9) + 1e-12, cost=1.0)
        p.at_least({self.Z: 1.0, self.Q[last]: -1.0}, starts[-1] - starts[last])

    def _copies_out(self) -> None:
        """One stream, in the order of the ops they follow; a release op waits for its tensor's copy."""
        p, previous = self.program, None
        order = sorted(range(len(self.menu.offloads)),
                       key=lambda i: (self.menu.offloads[i].candidate.last_forward,
                                      self.menu.offloads[i].candidate.tensor))
        for i in order:
            option = self.menu.offloads[i]
            a, d = option.candidate.last_forward, option.d2h_s / self.unit
            moved = {v: -d for v in self.prefetch[i].values()}
            end = self._time(self.starts[a + 1])
            p.at_least({end: 1.0, self.Q[a]: -1.0, **moved}, float(self.times[a]))
            if previous is not None:
                p.at_least({end: 1.0, previous: -1.0, **moved}, 0.0)
            previous = end
            for r, chosen in self.release[i].items():
                big = self.bound - self.starts[a + 1]
                p.at_least({self.P[r]: 1.0, end: -1.0, chosen: -big}, -big)
        if previous is not None:
            p.at_least({self.Z: 1.0, previous: -1.0}, 0.0)

    def _copies_in(self) -> None:
        """One stream, in the order they are issued; the first op to read a prefetched tensor waits for it."""
        p, previous = self.program, None
        jobs = sorted((q, o.candidate.last_forward, o.candidate.tensor, i, reader)
                      for i, o in enumerate(self.menu.offloads) for q, reader in zip(o.prefetches, o.readers))
        for q, _, _, i, reader in jobs:
            chosen, h = self.prefetch[i][q], self.menu.offloads[i].h2d_s / self.unit
            end = self._time(self.starts[q])
            p.at_least({end: 1.0, self.P[q]: -1.0, chosen: -h}, 0.0)
            if previous is not None:
                p.at_least({end: 1.0, previous: -1.0, chosen: -h}, 0.0)
            previous = end
            big = self.bound - self.starts[q]
            p.at_least({self.Q[reader]: 1.0, end: -1.0, chosen: -big}, -big)
        if previous is not None:
            p.at_least({self.Z: 1.0, previous: -1.0}, 0.0)

    def _stream_work(self) -> None:
        """Rows an integer solution meets anyway, which let the relaxation see the copies' time.

        A stream does one copy at a time: the copies out that start after op s and must be done
        before a release op r fit between s's end and r; the copies in issued at or after op s
        whose first readers come no later than op k fit between s and k. The sums run along a
        chain of running totals, one per s, so that rows stay short; at most STREAM_STARTS values
        of s, spread evenly, so that the rows grow with the ops and not with their square.
        """
        out: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for i, o in enumerate(self.menu.offloads):
            for r, chosen in self.release[i].items():
                out.setdefault((o.candidate.last_forward, r), []).append((chosen, o.d2h_s / self.unit))
        for s in _spread(sorted({a for a, _ in out})):
            self._running([(r, terms) for (a, r), terms in out.items() if a >= s],
                          lambda r, total, s=s: ({self.P[r]: 1.0, self.Q[s]: -1.0, total: -1.0},
                                                 float(self.times[s])))
        into: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for i, o in enumerate(self.menu.offloads):
            for (q, chosen), reader in zip(self.prefetch[i].items(), o.readers):
                into.setdefault((q, reader), []).append((chosen, o.h2d_s / self.unit))
        for s in _spread(sorted({q for q, _ in into})):
            self._running([(k, terms) for (q, k), terms in into.items() if q >= s],
                          lambda k, total, s=s: ({self.Q[k]: 1.0, self.P[s]: -1.0, total: -1.0}, 0.0))

    def _running(self, steps: list[tuple[int, list[tuple[int, float]]]], row) -> None:
        """A running total of the terms of ``steps`` (op, terms) in op order; at each op, the row ``row(op, total)``."""
        merged: dict[int, list[tuple[int, float]]] = {}
        for op, terms in steps:
            merged.setdefault(op, []).extend(terms)
        previous = None
        for op, terms in sorted(merged.items()):
            total = self.program.var(0.0)
            self.program.equal({total: 1.0, **({previous: -1.0} if previous is not None else {}),
                                **{v: -w for v, w in terms}}, 0.0)
            self.program.at_least(*row(op, total))
            previous = total

    def _memory(self, curve: np.ndarray, budget: float) -> None:
        """What is away changes only where a choice takes a tensor off or brings it back: between two such ops,
        the curve's highest op is the one to check."""
        self.made = self._made_at_ops()
        self.events = events = self._away_events(len(curve))
        edges = sorted(events)
        if float(curve[:edges[0] if edges else len(curve)].max(initial=0.0)) > budget:
            self.infeasible = True  # over the budget before any choice can take a tensor away
            return
        previous = None
        for op, top in zip(edges, np.maximum.reduceat(curve, edges) if edges else []):
            away = self.program.var(float(top) - budget, np.inf)
            self.program.equal({away: 1.0, **({previous: -1.0} if previous is not None else {}),
                                **{v: -c for v, c in events[op].items()}}, 0.0)
            previous = away

    def _away_events(self, ops: int) -> dict[int, dict[int, float]]:
        """Op -> {variable: MiB}: how much more of the keep-all curve is away from that op on, per unit of each
        variable (less where a choice puts more on the device than the curve has)."""
        events: dict[int, dict[int, float]] = {}

        def add(op: int, var: int, amount: float) -> None:
            if op < ops:
                events.setdefault(op, {})[var] = events.get(op, {}).get(var, 0.0) + amount

        for i, offload in enumerate(self.menu.offloads):
            for r, var in self.release[i].items():
                add(r, var, offload.size / MIB)
            for q, var in self.prefetch[i].items():
                add(q, var, -offload.size / MIB)
        for j, recompute in enumerate(self.menu.recomputes):
            for nbytes, (first, last) in zip(recompute.sizes, recompute.windows):
                if last > first:
                    add(first, self.recompute[j], nbytes / MIB)
                    add(last, self.recompute[j], -nbytes / MIB)
        for op, var, mib in self._held_sources():  # on the device beyond the curve
            add(op, var, -mib)
        for op, (made, mib) in self.made.items():  # scratch at the op the replays run before
            add(op, made, -mib)
            add(op + 1, made, mib)
        return events

    def _held_sources(self) -> list[tuple[int, int, float]]:
        """(op, variable, MiB per unit of it held from that op on) for the sources the runtime holds for the chosen
        recomputations: from the op after forward lets one go through the last chosen recomputation reading it
        (NOTE [simulated streams] 1). Where several options read it, a chain of variables, each at least the next
        and each chosen option's ending with it, holds it until the last of them."""
        by_tensor: dict[int, list[tuple[int, int, int, int]]] = {}
        for j, recompute in enumerate(self.menu.recomputes):
            for tensor, nbytes, first, last in recompute.held:
                if last > first:
                    by_tensor.setdefault(tensor, []).append((j, nbytes, first, last))
        changes = []
        for readers in by_tensor.values():
            _, nbytes, first, _ = readers[0]
            ends = sorted({last for _, _, _, last in readers})
            holding: dict[int, int] = {}  # end -> a variable: held past the ends before it
            for end in reversed(ends):
                options = [self.recompute[j] for j, _, _, last in readers if last == end]
                later = [holding[e] for e in ends if e > end][:1]
                holding[end] = options[0] if len(options) == 1 and not later else self._most(options + later)
            changes.append((first, holding[ends[0]], nbytes / MIB))
            for i, end in enumerate(ends):
                changes.append((end, holding[end], -nbytes / MIB))
                if i + 1 < len(ends):
                    changes.append((end, holding[ends[i + 1]], nbytes / MIB))
        return changes

    def _most(self, variables: list[int], scales: list[float] | None = None) -> int:
        """A continuous variable at least each of ``variables`` times its scale (1 by default); ``maxima`` keeps
        them, in the order made (each only of those made before it)."""
        scales = scales or [1.0] * len(variables)
        most = self.program.var(0.0, np.inf)
        for var, scale in zip(variables, scales):
            self.program.at_least({most: 1.0, var: -scale}, 0.0)
        self.maxima[most] = list(zip(variables, scales))
        return most

    def _made_at_ops(self) -> dict[int, tuple[int, float]]:
        """Op -> (a variable, MiB per unit of it): what the recomputations chosen before that op make beyond what
        they restore and its own allocations. They run one after another, and the simulator counts the most any of
        them holds at once beside the tensors those before it restored (NOTE [simulated streams] 8): at most the
        largest ``made_beyond`` among them, which a variable bounded below by each chosen one's stands for."""
        made: dict[int, list[int]] = {}
        for j, recompute in enumerate(self.menu.recomputes):
            if recompute.made_beyond:
                made.setdefault(recompute.action.at_op, []).append(j)
        variables = {}
        for op, options in made.items():
            if len(options) == 1:
                variables[op] = (self.recompute[options[0]], self.menu.recomputes[options[0]].made_beyond / MIB)
                continue
            variables[op] = (self._most([self.recompute[j] for j in options],
                                        [self.menu.recomputes[j].made_beyond / MIB for j in options]), 1.0)
        return variables

    def encode(self, choice: Choice) -> dict[int, float]:
        """A choice as values of the binary variables (the solver completes the rest)."""
        values = {v: 0.0 for v, integer in enumerate(self.program.integer) if integer}
        for i, release, prefetch in choice.offloads:
            values[self.release[i][release]] = values[self.prefetch[i][prefetch]] = 1.0
        for j in choice.recomputes:
            values[self.recompute[j]] = 1.0
        return values

    def read(self, x: np.ndarray) -> Choice:
        offloads = []
        for i in range(len(self.menu.offloads)):
            release = [r for r, v in self.release[i].items() if x[v] > 0.5]
            prefetch = [q for q, v in self.prefetch[i].items() if x[v] > 0.5]
            if release and prefetch:
                offloads.append((i, release[0], prefetch[0]))
        return Choice(tuple(offloads), tuple(j for j, v in enumerate(self.recompute) if x[v] > 0.5))


def _spread(values: list[int], most: int = STREAM_STARTS) -> list[int]:
    """At most ``most`` of ``values``, evenly spread, the first and the last among them."""
    if len(values) <= most:
        return values
    return [values[round(k * (len(values) - 1) / (most - 1))] for k in range(most)]

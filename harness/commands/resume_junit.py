"""resume-test --junit-xml: a ResumeReport as JUnit test cases, one per compared item.

  resume-test             equivalent (the verdict), resumed run (continues at k+1, each step once)
  resume-test.restore     model, optimizer, scheduler, rng.<stream> (each stream, all ranks), data: the live state
                          right after the restore against the checkpoint it was loaded from
  resume-test.final       the same items in both final checkpoints (same world size only)
  resume-test.steps       "step N <metric>" for loss, lr, grad_norm of every step (W->W': loss within tolerance
                          after the restart; lr and grad_norm are judged in resume-test.continuity)
  resume-test.continuity  loss, lr, grad_norm judged at the restart as `ckpt-audit continuity` judges (W->W')

A failing case carries the first difference and, on the component that explains the divergence (the culprit), the
first divergent step, so the CI report alone says what was not restored and where the run went off.
"""

from __future__ import annotations

from ckpt_audit.report_junit import Case, Suite, command_properties
from harness.compare import COMPONENTS
from harness.rng import STREAMS

BASE_STREAMS = tuple(s for s in STREAMS if s != "cuda")  # every stream a CPU run saves


def resume_suite(report, *, cuda: bool, model: dict | None = None) -> Suite:
    """`cuda`: the ranks ran on CUDA, so a `cuda` RNG stream was compared too."""
    step, metric = report.first_divergent_step, report.first_divergent_metric
    went_off = f"first divergent step {step} ({metric})" if step is not None else None
    cases = [_verdict(report, went_off), _structure(report)]
    streams = BASE_STREAMS + (("cuda",) if cuda else ())
    # the culprit is named from the restore check first, else from the final state (ResumeReport.culprit)
    blamed_group = "restore" if report.restore_differences else "final"
    groups = [("restore", report.restore_differences)]
    if report.mode == "exact":
        groups.append(("final", report.final_differences))
    for group, diffs in groups:
        seen = {d.key for d in diffs if d.component == "rng"}
        items = [(c, None) for c in COMPONENTS if c != "rng"]
        items[3:3] = [("rng", s) for s in (*streams, *sorted(seen - set(streams)))]
        for component, key in items:
            mine = [d for d in diffs if d.component == component and (key is None or d.key == key)]
            name = component if key is None else f"{component}.{key}"
            blamed = went_off if component == report.culprit and group == blamed_group else None
            cases.append(_differences(f"resume-test.{group}", name, mine, blamed))
    cases += _steps(report, went_off)
    cases += [_continuity(m) for m in report.continuity]
    extra = [("checkpointer", report.checkpointer_name), ("mode", report.mode)]
    extra += [("architecture", report.architecture or "unknown")]
    if model is not None:
        extra += [("model.source", model["source"])]
        extra += [(f"model.shrunk.{k}", f"{a} -> {b}") for k, (a, b) in model["shrunk"].items()]
    return Suite(name="resume-test", cases=tuple(cases), properties=command_properties(extra), seconds=report.seconds)


def _verdict(report, went_off: str | None) -> Case:
    if report.equivalent:
        return Case(classname="resume-test", name="equivalent", detail=report.summary())
    head = "INCONCLUSIVE" if report.inconclusive else "DIVERGED"
    culprit = f" (culprit: {report.culprit})" if report.culprit else ""
    message = f"{head}{culprit}" + (f": {went_off}" if went_off else "")
    return Case(classname="resume-test", name="equivalent", failure=message, kind=head.lower(), detail=report.summary())


def _structure(report) -> Case:
    s = report.spec
    name = f"resumed run continues at step {s.k + 1}"
    problems = [p for p in report.problems if not p.startswith("continuity:")]
    if not problems:
        return Case(classname="resume-test", name=name)
    return Case(classname="resume-test", name=name, failure=problems[0], kind="structure", detail="\n".join(problems))


def _differences(classname: str, name: str, diffs, went_off: str | None) -> Case:
    if not diffs:
        return Case(classname=classname, name=name)
    ranks = sorted({d.rank for d in diffs if d.rank is not None})
    where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    message = f"{len(diffs)} difference(s){where}; first: {diffs[0].describe()}"
    if went_off:
        message += f"; {went_off}"
    detail = "\n".join(d.describe() for d in diffs[:200])
    more = f"\n... and {len(diffs) - 200} more" if len(diffs) > 200 else ""
    return Case(classname=classname, name=name, failure=message, kind="not-restored", detail=detail + more)


def _steps(report, went_off: str | None) -> list[Case]:
    s, exact = report.spec, report.mode == "exact"
    resumed = {r.get("step"): r for r in report.resumed}
    out = []
    for a in report.straight:
        n, b = a["step"], resumed.get(a["step"], {})
        for m in ("loss", "lr", "grad_norm"):
            if not exact and n > s.k and m != "loss":
                continue  # judged as a whole by the continuity cases
            ref, got = a.get(m), b.get(m)
            if exact or n <= s.k:
                ok, how = ref == got, "bit for bit"
            else:
                dev = abs(got - ref) / abs(ref) if isinstance(got, float) and ref else float("inf")
                ok, how = dev <= s.tolerance, f"relative deviation {dev:.2e}, tolerance {s.tolerance:g}"
            case = Case(classname="resume-test.steps", name=f"step {n} {m}", detail=f"straight {ref!r}, {how}")
            if not ok:
                first = (
                    f"; {went_off}" if (n, m) == (report.first_divergent_step, report.first_divergent_metric) else ""
                )
                case = Case(
                    classname=case.classname,
                    name=case.name,
                    failure=f"straight {ref!r} vs resumed {got!r} ({how}){first}",
                    kind="diverged",
                    detail=case.detail,
                )
            out.append(case)
    return out


def _continuity(m) -> Case:
    problems = m.problems()
    j = m.judgement
    detail = f"score {j.score:+.1f} / {j.threshold:g}" if j is not None and j.sufficient else "no verdict"
    name = m.metric
    if not problems:
        return Case(classname="resume-test.continuity", name=name, detail=detail)
    return Case(
        classname="resume-test.continuity",
        name=name,
        failure=problems[0],
        kind="continuity",
        detail="\n".join([detail, *problems]),
    )

"""``nascompress study ...``: inspect Optuna studies (list, show, export, report, dashboard)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
import signal

import typer
from rich import box
from rich.table import Table

from nascompress.cli.common import err, out, print_json, run, setting_option, settings_command
from nascompress.cli.options import Force, JsonOut as Json, out_option
from nascompress.studies.dashboard import DashboardSettings, start_dashboard
from nascompress.studies.inspect import (
    ExportSettings,
    ShowSettings,
    export_study,
    list_studies,
    render_show,
    show_study,
)
from nascompress.studies.trials import SearchJob
from nascompress.studies.report import write_report

study_app = typer.Typer(no_args_is_help=True, help="Inspect search studies: list, show, export, report, dashboard.")

Storage = setting_option(SearchJob, "storage")  # the study's storage, as the search commands' --storage
Name = Annotated[str, typer.Argument(help="The study name (see 'nascompress study list').")]


@study_app.command("list")
def list_cmd(storage: Storage = None, json_out: Json = False) -> None:
    """Every study: objectives, trials complete/failed/running, best value or front size, created."""
    rows = run(list_studies, storage)
    if json_out:
        print_json([r.to_dict() for r in rows])
        return
    if not rows:
        out.print("no studies yet (nascompress-studies.db / .journal in this directory, or --storage)")
        return
    t = Table(
        title="studies",
        caption="db / journal: nascompress-studies.db / .journal here",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for col in ("study", "objectives", "done", "failed", "running", "best / front", "created", "storage"):
        t.add_column(col, justify="right" if col in ("done", "failed", "running") else "left")
    for r in rows:
        objs = " ".join(f"{n}{'↑' if d == 'maximize' else '↓'}" for n, d in zip(r.metric_names, r.directions))
        best = (
            f"front {r.front_size}"
            if r.front_size is not None
            else f"{r.best.value:.4g} (#{r.best.number})"
            if r.best
            else "-"
        )
        c = r.counts
        created = r.created[5:16].replace("T", " ") if r.created else "-"
        where = r.storage
        for default, short in (("nascompress-studies.db", "db"), ("nascompress-studies.journal", "journal")):
            if where.startswith(("sqlite:///", "journal:")) and Path(where.split(":", 1)[1]) == Path.cwd() / default:
                where = short
        t.add_row(
            r.name,
            objs,
            str(c.get("COMPLETE", 0)),
            str(c.get("FAIL", 0)),
            str(c.get("RUNNING", 0)),
            best,
            created,
            where,
        )
    out.print(t)


@study_app.command("show")
@settings_command(settings=ShowSettings)
def show_cmd(name: Name, storage: Storage = None, *, settings: ShowSettings, json_out: Json = False) -> None:
    """The Pareto front (or the best trials) with the parameters that differ between them."""
    res = run(show_study, name, storage, limit=settings.limit)
    if json_out:
        print_json(res.to_dict())
        return
    if not res.trials:
        out.print(f"study {name}: no complete feasible trials yet")
        return
    out.print(render_show(res))


@study_app.command("export")
@settings_command(settings=ExportSettings)
def export_cmd(
    name: Name,
    out_file: out_option("The file to write."),
    *,
    settings: ExportSettings,
    storage: Storage = None,
    force: Force = False,
) -> None:
    """Every trial (number, state, values, params, record fields) to CSV or JSON."""
    path = run(export_study, name, fmt=settings.format, out=out_file, storage=storage, force=force)
    out.print(f"wrote {path}")


@study_app.command("report")
def report_cmd(
    name: Name,
    out_file: out_option("The HTML file to write.") = Path("report.html"),
    storage: Storage = None,
    force: Force = False,
) -> None:
    """One self-contained HTML file: Pareto front, history, importances, the front as a table."""
    path = run(write_report, name, out=out_file, storage=storage, force=force)
    out.print(f"wrote {path}")


@study_app.command("dashboard")
@settings_command(settings=DashboardSettings)
def dashboard_cmd(name: Name, storage: Storage = None, *, settings: DashboardSettings) -> None:
    """Serve optuna-dashboard on the study's storage until Ctrl-C (or SIGTERM): read-only, on this
    machine only, unless asked otherwise."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    handle = run(start_dashboard, name, storage=storage, **vars(settings))
    try:  # from here on a Ctrl-C, however early, stops the server and removes the snapshot
        signal.signal(signal.SIGINT, interrupt)  # also when started in the background (SIGINT ignored there)
        signal.signal(signal.SIGTERM, interrupt)
        if handle.note:
            err.print(handle.note, highlight=False, soft_wrap=True)
        mode = "writable" if handle.writable else "read-only"
        out.print(f"optuna-dashboard for study {name}: {handle.study_url}  ({mode}; Ctrl-C to stop)", highlight=False)
        handle.wait()
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    err.print("dashboard stopped")


def register(app: typer.Typer) -> None:
    app.add_typer(study_app, name="study")

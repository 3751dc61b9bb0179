"""What ``nightly`` tells a CI runner of GitHub Actions or the Gitea family (Gitea, Forgejo: their
runners set ``GITHUB_ACTIONS=true`` and ``GITHUB_OUTPUT`` too); docs/nightly.md, "Scheduling".

- ``$GITHUB_OUTPUT``: where tonight's report is (``report_dir``, ``report_md``, ``report_json``,
  ``report_html``), the run's ``status`` and ``exit_code``, and ``failed_logs``: the failed
  stages' log files, one a line (the workflow uploads them as an artifact). The workflow reads
  tonight's report from these, never "the newest file in the folder".
- ``::group::IMAGE/STAGE`` folds with each stage's log (its last lines), ``::error`` lines: for a
  definition problem with ``file=`` and ``line=`` (the forge marks the line), for a failed stage
  with its RUN step's exit code.

Output only: nothing here decides anything about the run.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

GROUP_LINES = 400  # the last lines of each stage's log in its fold


def under_actions(env=None) -> bool:
    value = os.environ.get("GITHUB_ACTIONS") if env is None else env.get("GITHUB_ACTIONS")
    return value == "true"


def _prop(text) -> str:
    """A workflow command property (file=, line=, title=), escaped as the runners expect."""
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A").replace(":", "%3A") \
        .replace(",", "%2C")


def _msg(text) -> str:
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _abs(root: Path, shown: str | None) -> Path | None:
    if not shown:
        return None
    p = Path(shown)
    return p if p.is_absolute() else Path(root) / p


def failed_logs(doc: dict, root: Path) -> list[Path]:
    out = []
    for im in doc.get("images") or []:
        f = im.get("failure") or {}
        p = _abs(root, f.get("log"))
        if p is not None and p.is_file():
            out.append(p)
    return out


def commands(doc: dict, root: Path) -> list[str]:
    """The ``::group::`` folds (one per stage that ran) and ``::error`` lines of a nightly report."""
    from imagebuild.buildstep import buildlog

    out = []
    for im in doc.get("images") or []:
        for st in im.get("stages") or []:
            p = _abs(root, st.get("log"))
            if p is None or st.get("status") not in ("built", "failed"):
                continue
            out.append(f"::group::{im['image']}/{st['name']}: {st.get('status')} "
                       f"({st.get('seconds') if st.get('seconds') is not None else '-'} s)")
            text = buildlog.read_end(p)
            lines = (text or "(log not readable)").splitlines()[-GROUP_LINES:]
            out += [buildlog.clean(ln) for ln in lines]
            out.append("::endgroup::")
        f = im.get("failure") or {}
        for prob in f.get("problems") or []:
            props = [f"file={_prop(prob['file'])}"] + ([f"line={_prop(prob['line'])}"] if prob.get("line") else [])
            props.append(f"title={_prop(im['image'] + ': definition error')}")
            out.append(f"::error {','.join(props)}::{_msg((prob.get('key') + ': ' if prob.get('key') else '') + prob['message'])}")
        if f.get("stage"):
            what = (f"RUN exit {f['exit_code']} from `{f.get('command')}`" if f.get("exit_code") is not None
                    else "no step reported an exit code")
            out.append(f"::error title={_prop(im['image'] + '/' + f['stage'] + ' failed')}::"
                       + _msg(f"stage {f['stage']} of {im['image']} failed: {what}; log {f.get('log')}"))
        elif im.get("status") not in ("ok", None) and not f.get("problems"):
            out.append(f"::error title={_prop(im['image'] + ': ' + str(im['status']))}::{_msg(im.get('reason') or im['status'])}")
    return out


def write_outputs(file: str | os.PathLike, doc: dict, stored, root: Path) -> None:
    """Append tonight's report paths and the failed stages' logs to ``$GITHUB_OUTPUT``."""
    html = stored.json_path.with_suffix(".html")
    values = {"report_dir": str(Path(stored.md_path).parent.resolve()), "report_md": str(Path(stored.md_path).resolve()),
              "report_json": str(Path(stored.json_path).resolve()),
              "report_html": str(html.resolve()) if html.is_file() else "",
              "run_id": doc["run_id"], "status": doc["status"], "exit_code": str(doc["exit_code"]),
              "failed_logs": "\n".join(str(p.resolve()) for p in failed_logs(doc, root))}
    parts = []
    for k, v in values.items():
        if "\n" in v:
            delim = f"IMAGEBUILD_EOF_{secrets.token_hex(8)}"
            parts.append(f"{k}<<{delim}\n{v}\n{delim}\n")
        else:
            parts.append(f"{k}={v}\n")
    with open(file, "a", encoding="utf-8") as f:  # the runner's own file: appended to, as it expects
        f.write("".join(parts))

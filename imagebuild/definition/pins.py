"""versions.env's pins: git sources (``NAME_REPO``, ``NAME_REF``, ``NAME_PRS``) and image references.

Part of reading a definition (definition_model.py lists the parts). Problems go to the collector.
"""

from __future__ import annotations

from imagebuild.definition import envfile
from imagebuild.definition.model import (
    DIGEST_RE,
    HEXISH_RE,
    IMAGE_REF_RE,
    PR_RE,
    REF_NAME_RE,
    REPO_URL_RE,
    SHA_RE,
    Collector,
    GitSource,
    ImageRef,
    PullRequest,
)


def git_sources(env: envfile.EnvFile, c: Collector) -> dict[str, GitSource]:
    f = env.display
    sources: dict[str, GitSource] = {}
    names = {k[: -len("_REPO")] for k in env.entries if k.endswith("_REPO")}
    broken_names = {k[: -len("_REPO")] for k in env.broken if k.endswith("_REPO")}
    # _PRS / _TREE without a _REPO
    for key in env.entries:
        for suffix in ("_PRS", "_TREE"):
            if key.endswith(suffix) and key[: -len(suffix)] not in names | broken_names:
                c.err(f, f"{key} has no matching {key[: -len(suffix)]}_REPO", line=env.line_of(key), key=key,
                      hint=f"add {key[: -len(suffix)]}_REPO=<git URL> or remove the line")
    for name in sorted(names):
        rk, fk, pk = f"{name}_REPO", f"{name}_REF", f"{name}_PRS"
        repo = env.get(rk) or ""
        ok = True
        if not REPO_URL_RE.match(repo):
            c.err(f, f"invalid repository URL {repo!r}: expected https://, git://, ssh://, file:// or "
                  "user@host:path", line=env.line_of(rk), key=rk)
            ok = False
        ref = env.get(fk)
        follows, ref_ok = None, True
        if ref and "@" in ref:  # <branch or tag>@<sha>: a pin that remembers what it follows
            follows, _, ref = ref.rpartition("@")
            if not REF_NAME_RE.match(follows) or ".." in follows:
                c.err(f, f"invalid ref name {follows!r} before '@' (expected a branch or tag name)",
                      line=env.line_of(fk), key=fk, hint=f"write {fk}=<branch or tag>@<40-hex sha>, or only one")
                ok = ref_ok = False
            elif not SHA_RE.match(ref):
                c.err(f, f"{follows}@{ref}: {ref!r} is not a full 40-hex commit sha", line=env.line_of(fk), key=fk,
                      hint=f"write {fk}={follows} and let prefetch pin it as {follows}@<sha>")
                ok = ref_ok = False
        if not ref_ok:
            pass
        elif ref is None:
            c.err(f, f"git source {name} has {rk} but no {fk}", line=env.line_of(rk), key=fk,
                  hint=f"add {fk}=<full 40-hex commit sha>")
            ok = False
        elif not ref:
            c.err(f, "empty ref", line=env.line_of(fk), key=fk, hint="give the full 40-hex commit sha")
            ok = False
        elif not SHA_RE.match(ref):
            if HEXISH_RE.match(ref):
                if len(ref) == 40:
                    c.err(f, "commit sha must be lower-case hex", line=env.line_of(fk), key=fk)
                else:
                    c.err(f, f"short or malformed commit sha {ref!r} ({len(ref)} hex digits): expected "
                          "the full 40-hex commit", line=env.line_of(fk), key=fk,
                          hint="abbreviated shas are ambiguous; `git rev-parse <sha>` in a clone gives the "
                          "full one")
                ok = False
            elif REF_NAME_RE.match(ref):
                c.note(f, f"ref {ref!r} is a name, not a commit: unpinned (imagebuild prefetch resolves it)",
                       line=env.line_of(fk), key=fk)
            else:
                c.err(f, f"invalid ref {ref!r}: expected a full 40-hex commit sha", line=env.line_of(fk), key=fk)
                ok = False
        prs: list[PullRequest] = []
        raw_prs = env.get(pk)
        if raw_prs is not None:
            seen: set[int] = set()
            for item in raw_prs.replace(",", " ").split():
                m = PR_RE.match(item)
                if not m:
                    c.err(f, f"invalid pull request {item!r}: expected N or N@<40-hex sha>",
                          line=env.line_of(pk), key=pk, hint='e.g. VLLM_PRS="550@<sha> 552"')
                    ok = False
                    continue
                num, sha = int(m.group("num")), m.group("sha")
                if sha is not None and not SHA_RE.match(sha):
                    c.err(f, f"pull request {num}: {sha!r} is not a full 40-hex commit sha",
                          line=env.line_of(pk), key=pk,
                          hint=f"write {num}@<40-hex sha>, or a bare {num} to let prefetch pin it")
                    ok = False
                    continue
                if num in seen:
                    c.err(f, f"pull request {num} is listed twice", line=env.line_of(pk), key=pk)
                    ok = False
                    continue
                seen.add(num)
                if sha is None:
                    c.note(f, f"pull request {num} is not pinned (imagebuild prefetch pins its head)",
                           line=env.line_of(pk), key=pk)
                prs.append(PullRequest(num, sha))
        tk = f"{name}_TREE"
        tree = env.get(tk)
        if tree is not None and not SHA_RE.match(tree):
            c.err(f, f"{tree!r} is not a git tree id: expected 40 lower-case hex digits (the tree the "
                  f"composition of {fk} and {pk} must produce)", line=env.line_of(tk), key=tk,
                  hint="`git rev-parse <composed commit>^{tree}` (or `git write-tree` of the composition) gives it")
            ok = False
        if ok and ref is not None:
            sources[name] = GitSource(name, repo, ref, tuple(prs), follows, tree)
    return sources


def parse_image_ref(key: str, value: str) -> tuple[ImageRef | None, str | None]:
    """(ref, error message)."""
    m = IMAGE_REF_RE.match(value or "")
    if not m:
        return None, (f"invalid image reference {value!r}: expected name:tag@sha256:<64 hex>")
    digest = m.group("digest")
    if digest is not None and not DIGEST_RE.match(digest):
        return None, (f"invalid digest {digest!r}: expected sha256: followed by 64 lower-case hex digits")
    return ImageRef(key, value, m.group("name"), m.group("tag"), digest), None

"""The rules a stage's Dockerfile must follow, checked at plan time (docs/image-definition.md):
``FROM`` names only ``${PARENT}``, an earlier stage, a versions.env key, an alias or scratch; every
``ARG`` has a value; ``COPY`` only what the stage declares; no literal image in ``COPY --from`` or a
``RUN --mount from=``; build args that fit a command line; patch scripts that compile.

Part of reading a definition (definition_model.py lists the parts).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from imagebuild.definition import dockerfile as dockerfile_mod
from imagebuild.definition.model import (
    ARG_BUILD_ID,
    ARG_IMAGE,
    ARG_PARENT,
    ARG_STAGE,
    BUILD_CONTEXT_PREFIX,
    BUILDKIT_ARGS,
    NAMED_CONTEXTS,
    STAGE_ARG_PREFIX,
    STAGE_CONTEXT_PREFIX,
    ArgSource,
    Collector,
    InputFile,
    difflib,
    read_text,
    stage_arg,
)
from imagebuild.definition.pins import parse_image_ref

# The build args of one stage all go on one docker command line. Linux allows ARG_MAX (usually
# 2 MiB) for the arguments and the environment together; half of it is left to the environment.
BUILD_ARGS_MAX = 1 << 20


def args_fit_command_line(name, parsed, df_disp, env, args, c) -> bool:
    total = 0
    for a in args:
        if a.origin == "versions.env":
            total += len("--build-arg") + len(f"{a.name}={env.get(a.name)}".encode()) + 2
            if total > BUILD_ARGS_MAX:
                line = next(x.line for x in parsed.args if x.name == a.name)
                c.err(df_disp, f"stage {name!r}: its build args from versions.env reach {total} bytes at ARG "
                      f"{a.name}: more than {BUILD_ARGS_MAX} bytes (half of Linux's usual 2 MiB ARG_MAX) on "
                      "one docker command line", line=line, key=a.name,
                      hint="pins are short: put long content in a file the stage lists under 'files:'")
                return False
    return True


def _check_from_refs(parsed, df_disp, env, plan_args, aliases, earlier, c) -> bool:
    """``COPY --from=X`` and ``RUN --mount=...,from=X``: X is a stage of this Dockerfile (its name or
    index), a build context imagebuild provides, or exactly ${NAME} with NAME PARENT, an earlier
    stage's STAGE_* arg or a versions.env key holding an image. Never a literal image: every image
    pin lives in versions.env."""
    ok = True
    declared = set(parsed.arg_names())
    refs = [(f"{cp.keyword} --from={cp.from_stage!r}", cp.from_stage, cp.line) for cp in parsed.copies
            if cp.from_stage is not None]
    refs += [(f"RUN --mount from={value!r}", value, line) for value, line in parsed.mount_froms]
    for what, value, line in refs:
        var = dockerfile_mod.variable(value)
        if value in aliases or value in NAMED_CONTEXTS or \
                (value.startswith(STAGE_CONTEXT_PREFIX) and value[len(STAGE_CONTEXT_PREFIX):] in earlier) or \
                (value.isdigit() and int(value) < len(parsed.froms)):
            continue
        if value.startswith(BUILD_CONTEXT_PREFIX):
            c.err(df_disp, f"{what}: {value!r} is no build context imagebuild passes (those are "
                  f"{', '.join(sorted(NAMED_CONTEXTS))} and {STAGE_CONTEXT_PREFIX}<an earlier stage>): "
                  "as an image it would be brought in from outside versions.env", line=line,
                  hint="pin the image in versions.env (KEY=<image>@sha256:<digest>, 'ARG KEY', ${KEY}), or use "
                  "one of the named contexts")
            ok = False
            continue
        if var is not None:
            if var not in plan_args and env.get(var) is None:
                c.err(df_disp, f"{what}: {var} is neither PARENT, an earlier stage's STAGE_* arg, nor a "
                      "versions.env key", line=line, key=var)
                ok = False
            elif var not in declared:
                c.err(df_disp, f"{what}: no 'ARG {var}' declares it", line=line, key=var,
                      hint=f"add 'ARG {var}' before the first FROM")
                ok = False
            elif var not in plan_args:
                _, msg = parse_image_ref(var, env.get(var))
                if msg:
                    c.err(env.display, msg, line=env.line_of(var), key=var)
                    ok = False
            continue
        if value in earlier:
            hint = (f"{value!r} is an imagebuild stage, not a stage of this Dockerfile: declare "
                    f"'ARG {stage_arg(value)}' before the first FROM and write ${{{stage_arg(value)}}}")
        else:
            hint = ("every image pin lives in versions.env: add KEY=<image>@sha256:<digest> there, declare "
                    "'ARG KEY' before the first FROM and write ${KEY}; or name a stage of this Dockerfile "
                    "(FROM ... AS NAME)")
        c.err(df_disp, f"{what} names an image outside versions.env", line=line, hint=hint)
        ok = False
    return ok


def compiles(path: Path, display: str, c: Collector) -> bool:
    """Compile a patch script without running it: a syntax error is reported with its line."""
    text = read_text(path, display, c)
    if text is None:
        return False
    try:
        compile(text, display, "exec", dont_inherit=True)
    except SyntaxError as exc:
        c.err(display, f"does not compile: {exc.msg}", line=exc.lineno,
              hint="fix the patch script (imagebuild compiles every patch when it reads the definition, "
              "and runs none)")
        return False
    except ValueError as exc:  # e.g. "source code string cannot contain null bytes"
        c.err(display, f"does not compile: {exc}")
        return False
    return True


def check_dockerfile(name, parsed, df_disp, env, earlier, inputs, args_out, c, check_copies=True) -> bool:
    ok = True
    if parsed.syntax_directive:
        c.err(df_disp, "a '# syntax=' directive makes BuildKit pull a frontend image from a registry",
              line=parsed.syntax_directive, hint="remove the line; the built-in frontend is used")
        ok = False
    if not parsed.froms:  # named by a line: the first instruction's, or line 1 of an empty file
        first = parsed.instructions[0] if parsed.instructions else None
        c.err(df_disp, f"no FROM instruction (the first is {first.keyword} on line {first.line})" if first else
              "is empty: no instruction, no FROM", line=first.line if first else 1,
              hint="start the stage with: ARG PARENT / FROM ${PARENT}")
        return False
    plan_args = {ARG_PARENT, ARG_IMAGE, ARG_STAGE} | {stage_arg(s) for s in earlier}
    declared = parsed.defaults()
    global_args = {a.name for a in parsed.args if a.global_scope}
    aliases: set[str] = set()
    uses_parent = False
    for fr in parsed.froms:
        var = fr.variable
        if fr.image.lower() == "scratch" or fr.image in aliases:
            pass
        elif var is not None:
            if var not in global_args:
                c.err(df_disp, f"FROM uses ${{{var}}} but no 'ARG {var}' comes before the first FROM",
                      line=fr.line, key=var, hint=f"add 'ARG {var}' at the top of the Dockerfile")
                ok = False
            elif var == ARG_PARENT:
                uses_parent = True
            elif var.startswith(STAGE_ARG_PREFIX) and var in plan_args:
                pass
            elif env.get(var) is not None:
                ref, msg = parse_image_ref(var, env.get(var))
                if msg:
                    c.err(env.display, msg, line=env.line_of(var), key=var)
                    ok = False
            elif var not in plan_args:
                c.err(df_disp, f"FROM ${{{var}}}: {var} is neither PARENT, an earlier stage's STAGE_* "
                      "arg, nor a versions.env key", line=fr.line, key=var)
                ok = False
        elif "$" in fr.image:
            c.err(df_disp, f"FROM {fr.image!r}: use exactly ${{NAME}} for a variable image",
                  line=fr.line)
            ok = False
        else:
            c.err(df_disp, f"FROM {fr.image!r} names an image outside versions.env", line=fr.line,
                  hint="every pin lives in versions.env: build FROM ${PARENT} (the stage's 'from') or an "
                  "earlier stage's ${STAGE_<NAME>}")
            ok = False
        if fr.alias:
            aliases.add(fr.alias)
    ok &= _check_from_refs(parsed, df_disp, env, plan_args, aliases, earlier, c)
    if not uses_parent:
        c.err(df_disp, f"stage {name!r} never builds FROM ${{PARENT}}",
              line=parsed.froms[0].line, key=ARG_PARENT,
              hint="declare 'ARG PARENT' before the first FROM and write 'FROM ${PARENT}'; the plan feeds "
              "it the stage's 'from'")
        ok = False

    for argname in parsed.arg_names():
        line = next(a.line for a in parsed.args if a.name == argname)
        if argname == ARG_BUILD_ID:
            c.err(df_disp, f"ARG {argname}: a stage cannot receive the build id", line=line, key=argname,
                  hint="the build id is derived from every stage's key, so no stage can depend on it; the "
                  "release image carries it (label io.imagebuild.build-id, /opt/imagebuild/build.json)")
            ok = False
        elif env.get(argname) is not None:
            if argname in plan_args:
                c.err(env.display, f"{argname} is provided by imagebuild and cannot be set in versions.env",
                      line=env.line_of(argname), key=argname)
                ok = False
            else:
                args_out.append(ArgSource(argname, "versions.env", declared[argname]))
        elif argname in plan_args:
            args_out.append(ArgSource(argname, "plan"))
        elif argname.startswith(STAGE_ARG_PREFIX) and argname[len(STAGE_ARG_PREFIX):]:
            c.err(df_disp, f"ARG {argname}: no earlier stage is called "
                  f"{argname[len(STAGE_ARG_PREFIX):].lower().replace('_', '-')!r}", line=line, key=argname,
                  hint=f"earlier stages: {', '.join(earlier) or 'none'}")
            ok = False
        elif argname in BUILDKIT_ARGS:
            args_out.append(ArgSource(argname, "buildkit"))
        elif declared[argname] is not None:
            args_out.append(ArgSource(argname, "default", declared[argname]))
        else:
            close = difflib.get_close_matches(argname, list(env.entries), n=1)
            c.err(df_disp, f"ARG {argname} has no value: not in versions.env and no default", line=line,
                  key=argname,
                  hint=(f"did you mean {close[0]!r} in versions.env?" if close else
                        f"add {argname}=<value> to versions.env, or give a default: ARG {argname}=<value>"))
            ok = False

    for cp in parsed.copies if check_copies else ():
        if cp.from_stage:
            continue
        for src in cp.sources:
            if re.match(r"[a-z]+://", src):
                c.err(df_disp, f"{cp.keyword} from a URL ({src}) needs the network during the build",
                      line=cp.line, hint="download it with prefetch and declare it under 'files'")
                ok = False
                continue
            if not _covered(src, inputs):
                c.err(df_disp, f"{cp.keyword} {src!r}: not declared in the stage's files or patches",
                      line=cp.line, key=src,
                      hint="the build context holds only declared inputs (they are part of the cache key); "
                      "add it to 'files:' in image.yaml")
                ok = False
    return ok


def _covered(src: str, inputs: list[InputFile]) -> bool:
    s = src.lstrip("./").rstrip("/")
    if s in ("", "."):
        return bool(inputs)
    for i in inputs:
        cp = i.context_path
        if s == cp or s.startswith(cp + "/") or fnmatch.fnmatch(cp, s) or cp.startswith(s + "/"):
            return True
    return False

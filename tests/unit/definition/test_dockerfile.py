from imagebuild.definition import dockerfile


def test_args_froms_copies_with_lines():
    text = """\
# comment
ARG PARENT
ARG STAGE_X
FROM ${STAGE_X} AS x
FROM $PARENT
ARG A=1 B="two words"
RUN echo a \\
    # a comment inside a continuation
    && echo b
COPY --from=x /a /b
COPY --chmod=755 files/a.sh files/b.sh /opt/
RUN <<EOF
FROM not-an-instruction
EOF
ADD https://example.invalid/x /x
"""
    df = dockerfile.parse(text)
    assert [(a.name, a.default, a.line, a.global_scope) for a in df.args] == [
        ("PARENT", None, 2, True), ("STAGE_X", None, 3, True), ("A", "1", 6, False), ("B", "two words", 6, False)]
    assert [(f.image, f.alias, f.line, f.variable) for f in df.froms] == [
        ("${STAGE_X}", "x", 4, "STAGE_X"), ("$PARENT", None, 5, "PARENT")]
    assert [(c.sources, c.from_stage, c.line) for c in df.copies] == [
        (("/a",), "x", 10), (("files/a.sh", "files/b.sh"), None, 11), (("https://example.invalid/x",), None, 15)]
    run = [i for i in df.instructions if i.keyword == "RUN"][0]
    assert run.args == "echo a && echo b" and run.line == 7
    assert df.syntax_directive is None


def test_syntax_directive_detected():
    assert dockerfile.parse("# syntax=docker/dockerfile:1\nFROM scratch\n").syntax_directive == 1
    assert dockerfile.parse("FROM scratch\n# syntax=x\n").syntax_directive is None


def test_run_mounts():
    df = dockerfile.parse("FROM scratch\nRUN --mount=type=bind,from=imagebuild-src,target=/s --network=none ls\n")
    ins = df.instructions[1]
    assert dockerfile.run_mounts(ins) == [{"type": "bind", "from": "imagebuild-src", "target": "/s"}]


def test_word_split_fast_path_matches_shlex():
    """Lines without quotes or escapes skip shlex (start-up time); the words must be the same."""
    import random
    import shlex

    from imagebuild.definition import dockerfile

    rnd = random.Random(9)
    chars = "ab =\t-\"'\\$x{}#\x0b\xa0"
    for _ in range(5000):
        s = "".join(rnd.choice(chars) for _ in range(rnd.randint(0, 24)))
        try:
            want = shlex.split(s, posix=True)
        except ValueError:
            want = s.split()
        assert dockerfile._split(s) == want, repr(s)


def test_the_named_contexts_a_dockerfile_may_use_are_those_the_build_passes():
    """definition/model.py's list (what validate accepts) is the build's own list (what it passes)."""
    from imagebuild.buildstep import builder, compilecache
    from imagebuild.definition import model
    from imagebuild.fetch import packages
    from imagebuild.plan import planner, source_mounts

    passed = {source_mounts.CONTEXT, packages.WHEELS_CONTEXT, packages.APT_CONTEXT, planner.PARENT_CONTEXT,
              builder.NAMED_SRC, builder.NAMED_WHEELS, builder.NAMED_APT, compilecache.NAMED_CCACHE}
    assert model.NAMED_CONTEXTS == passed
    assert planner.stage_context("x") == model.STAGE_CONTEXT_PREFIX + "x"


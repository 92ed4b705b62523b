import io

from workbench.progress import NullProgress, TextProgress, make_progress


def test_text_progress_prints_only_changes():
    out = io.StringIO()
    progress = TextProgress(out)
    for done in (0, 0, 1, 1, 2):
        progress.update("engines registered", done, 2)
    progress.close("ready")
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "engines registered 0/2", "engines registered 1/2", "engines registered 2/2", "ready",
    ]


def test_outside_a_notebook_progress_is_text_and_can_be_turned_off():
    assert isinstance(make_progress(True), TextProgress)
    assert isinstance(make_progress(False), NullProgress)
    sink = NullProgress()
    assert make_progress(sink) is sink

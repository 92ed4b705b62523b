import io

from workbench.progress import BarProgress, NullProgress, make_progress


def test_a_bar_per_phase_ends_with_the_message():
    out = io.StringIO()
    progress = BarProgress(file=out, ncols=80, mininterval=0)
    for done in (0, 1, 1, 2):
        progress.update("engines registered", done, 2)
    progress.close("ready")
    progress.update("scaling", 0, 1)
    progress.close("scaling failed", ok=False)
    final = [part.strip() for part in out.getvalue().replace("\n", "\r").split("\r") if part.strip()]
    assert final[0].startswith("engines registered:   0%") and "0/2" in final[0]
    assert any(line.startswith("ready: 100%") and "2/2" in line for line in final), final
    assert any(line.startswith("scaling failed:   0%") and "0/1" in line for line in final), final


def test_progress_is_a_bar_and_can_be_turned_off():
    assert isinstance(make_progress(True), BarProgress)
    assert isinstance(make_progress(False), NullProgress)
    sink = NullProgress()
    assert make_progress(sink) is sink

"""integration/instance_methods.py: the instance-level wrappers of the gradient-noise-scale, packing-balance and
router-health callbacks, undone without breaking anyone else's wrapper in the same chain."""

from __future__ import annotations

from hf_gradfix.integration.instance_methods import InstanceMethods


class Logger:
    def __init__(self):
        self.seen = []

    def log(self, logs):
        self.seen.append(dict(logs))


def _adding(key, live=lambda: True):
    def make(original):
        def log(logs):
            if live():
                logs[key] = logs.get(key, 0) + 1
            return original(logs)
        return log
    return make


def test_removal_puts_back_a_wrapper_installed_before_ours():
    """Someone's wrapper (A) was on the instance first; ours goes on top and comes off: A stays (deleting the
    instance attribute, which the callbacks did before, would have dropped A too: the control)."""
    obj, methods = Logger(), InstanceMethods()
    obj.log = _adding("a")(obj.log)
    a = obj.log
    methods.wrap(obj, "log", _adding("ours"))
    obj.log({})
    methods.remove_all()
    assert obj.log is a
    obj.log({})
    assert obj.seen == [{"ours": 1, "a": 1}, {"a": 1}]
    control = Logger()
    control.log = _adding("a")(control.log)
    control.log = _adding("ours")(control.log)
    del control.__dict__["log"]  # the old removal
    control.log({})
    assert control.seen == [{}]  # A is gone with it


def test_a_wrapper_added_after_ours_stays_and_ours_passes_calls_through():
    obj, methods = Logger(), InstanceMethods()
    ours = methods.wrap(obj, "log", lambda original: _adding("ours", lambda: methods.live(ours))(original))
    obj.log = _adding("later")(obj.log)
    later = obj.log
    methods.remove_all()
    assert obj.log is later  # not unlinked
    obj.log({})
    assert obj.seen == [{"later": 1}]  # our wrapper, still in their chain, adds nothing
    assert not methods.live(ours)


def test_wrapping_again_while_installed_keeps_our_wrapper():
    obj, methods = Logger(), InstanceMethods()
    first = methods.wrap(obj, "log", _adding("ours"))
    again = methods.wrap(obj, "log", _adding("ours"))
    assert again is first and methods.all_installed()
    obj.log({})
    assert obj.seen == [{"ours": 1}]  # once, not twice
    methods.remove_all()
    assert "log" not in obj.__dict__ and not methods.all_installed()

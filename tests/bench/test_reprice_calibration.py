"""bench/reprice_calibration.py's step section: a recorded whole-step row re-planned from shapes (~5 s)."""

from bench import reprice_calibration as rc


def test_step_rows_are_repriced_from_shapes_with_the_results_preset():
    # an h100 row as old files stored it (no "overrides"), and an h200 one with overrides
    old = {"model": "mlp", "config": "debug", "measured": 1e-3, "predicted": 2e-3,
           "compiled_memory": {"argument+temp": 1 << 20}, "predicted_memory": {"argument+temp": 1.5 * (1 << 20)}}
    new = dict(old, overrides={"batch_size": 16})
    for preset, row in (("h100-sxm", old), ("h200-sxm", new)):
        results = {"meta": {"device_kind": "test", "preset": preset}, "sections": {"step": [row]}}
        [r] = rc.reprice(results, rc.get_hardware(preset))
        assert r["then"] == 0.5 and r["mem_then"] == 0.5 and r["now"] > 0 and r["predicted_mib"] > 0
        text = rc.markdown([r], results)
        assert "## whole train steps" in text and "+50.0%" in text
    assert rc.step_label(new) == "mlp debug batch_size=16"

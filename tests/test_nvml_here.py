"""NVML on this machine: the real library, whatever it finds."""


from tfmem_widgets.tf import nvml


def test_read_gpus_answers_or_says_why_in_one_line():
    try:
        gpus = nvml.read_gpus()
    except nvml.NvmlUnavailable as exc:
        assert str(exc).startswith("NVML not available") and "\n" not in str(exc)
        return
    for gpu in gpus:
        assert gpu.total_bytes > 0 and 0 <= gpu.used_bytes <= gpu.total_bytes


def test_the_report_always_says_what_the_driver_sees(lab_session):
    import tfmem_widgets

    report = tfmem_widgets.report()
    if report.gpus:  # a GPU in use by TensorFlow: its rows carry the driver's figures
        return
    driver_line = report.lines()[-1]
    assert driver_line.startswith(("NVML not available", "NVML sees")) and "\n" not in driver_line
    assert driver_line in report._repr_html_().replace("&#x27;", "'")


def test_a_driver_whose_gpus_tensorflow_does_not_use_is_named_with_the_reason(lab_session, monkeypatch):
    # NVML answers (as on a GPU machine with CUDA_VISIBLE_DEVICES=''): only the driver is
    # replaced here, the rest of the report is real.
    import tfmem_widgets

    card = nvml.GpuMemory(0, "NVIDIA H200", "GPU-1", 150 << 30, 1 << 30, 149 << 30, ())
    monkeypatch.setattr(nvml, "read_gpus", lambda: [card])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = tfmem_widgets.report()
    assert report.lines()[-1] == (
        "NVML sees 1 GPU(s) (NVIDIA H200), none in use by TensorFlow here: "
        "CUDA_VISIBLE_DEVICES='' hides them from TensorFlow"
    )

"""What the forward pass reports: the stage catalogue (``stages``), the trace events and their
recorder (``recorder``), and hooks that replace a stage's output (``hooks``)."""

"""Views of trace events: log lines, tables, JSON lines (``render``), flow diagrams
(``diagram``), the interactive page (``page``) and matplotlib pictures (``plots``)."""

"""Reading a run back: its TensorBoard events as metrics and events (`report`) and its figure (`figure`,
`report --plot`)."""

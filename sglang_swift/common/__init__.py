"""Small host-level helpers shared by the control channel and the data plane."""

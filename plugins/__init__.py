"""Custom ops the engines need, one module each, registered with `torch.library` under
the `specpipe::` namespace: a plain-torch reference (the CPU path and the test oracle)
plus a fake kernel for shape propagation."""

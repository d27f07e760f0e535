"""Model definitions (nn.Modules) and checkpoint loading."""

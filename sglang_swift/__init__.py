"""SwiftCache: an SGLang extension that lends idle HBM between co-located model servers.

Importing this package has no side effects: SGLang is touched only from `plugin.register()`,
which SGLang's plugin loader calls through the `sglang.srt.plugins` entry point.
"""

__version__ = "0.1.0"

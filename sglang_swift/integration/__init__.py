"""SwiftCache inside SGLang: the plugin (flag, options, hooks), `SwiftConfig`, the `swiftcache`
backend factory, the one cache class (`SwiftRadixCache`), the per-server runtime that ties the
control channel and the data plane to it, and the Prometheus series. Nothing here runs at import;
SGLang calls `plugin.register()` through the `sglang.srt.plugins` entry point."""

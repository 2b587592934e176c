"""SwiftCache's measuring apparatus: simulator, node benchmark, load generator, workloads, demo,
chaos run, local server launcher and control-channel peers. Not part of the installed package;
it imports the product, never the reverse."""

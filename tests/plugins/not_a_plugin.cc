// A shared library without Tessera's entry point (plugin_test).
extern "C" __attribute__((visibility("default"))) int not_a_plugin_answer() { return 42; }

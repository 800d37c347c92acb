// The kiln command line (flags parsed with CLI11).
#include <CLI/CLI.hpp>
#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"kiln: compile exported ONNX models into training programs"};
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);
  return 0;
}

// The Python objects of ngramcache.client._core (what each holds of the core) and the
// functions that bind them, one per file; bindings.cc calls each from NB_MODULE.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>

#include "convert.h"
#include "ngc/builder.h"
#include "ngc/drafter.h"
#include "ngc/shared_table.h"
#include "ngc/static_cache.h"

namespace ngc::py {

// StaticCache: a mapped file, shared with the drafters it is attached to.
struct PyStaticCache {
  std::shared_ptr<const StaticCache> cache;
  std::string path;  // as opened; names the file in errors
};

// CountTable: a SharedCountTable shared with Python and with the drafters it is attached to.
struct PyCountTable {
  std::shared_ptr<SharedCountTable> shared = std::make_shared<SharedCountTable>();
};

// Drafter: the core's drafter and the Python objects attached to it (kept for the
// `static` and `dynamic` properties, so they return the very objects given).
struct PyDrafter {
  std::unique_ptr<Drafter> drafter;
  nb::object static_ref = nb::none();
  nb::object dynamic_ref = nb::none();
};

// StaticBuilder: a core Builder, spent once finish() has run (successfully or not).
struct PyStaticBuilder {
  std::unique_ptr<Builder> builder;
  bool finished = false;

  // The builder, or an InvalidArgumentError once it is spent.
  Builder& get() {
    if (finished) raise_status(Status::InvalidArgument("this StaticBuilder has finished; create a new one"));
    return *builder;
  }
};

// `obj` as a StaticCache (null for None); a TypeError naming `what` for anything else.
PyStaticCache* as_static_cache(nb::handle obj, const char* what);
// `obj` as a CountTable (null for None); a TypeError naming `what` for anything else.
PyCountTable* as_count_table(nb::handle obj, const char* what);

// The match mode's tuning: the defaults overridden by a dict of {name: number} or None
// (MatchParams::set() checks each); used by Drafter and replay().
MatchParams match_params_from(nb::handle overrides);

void bind_static_cache(nb::module_& m);
void bind_count_table(nb::module_& m);
void bind_drafter(nb::module_& m);
void bind_builder(nb::module_& m);
void bind_functions(nb::module_& m);

}  // namespace ngc::py

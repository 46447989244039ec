// The version of the pathways libraries a program runs against (the project's VERSION in
// CMakeLists.txt), for outside programs to check or print.
#pragma once

namespace pathways {

const char* LibraryVersion();

}  // namespace pathways

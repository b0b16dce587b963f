//! One module per command.

pub mod bench;
pub mod generate;
pub mod inspect;
pub mod models;
pub mod producer;
